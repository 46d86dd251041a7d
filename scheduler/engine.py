"""The engine loop: each step packs running decodes and prefill chunks under a token
budget, sends one StepRequest to the worker and folds the sampled tokens back in."""
from __future__ import annotations

import logging
from collections import deque
from typing import Callable

import numpy as np

from scheduler.block_manager import BlockManager
from scheduler.sequence import Sequence, Status
from shared.step import SeqChunk, StepRequest, StepResult

log = logging.getLogger(__name__)

Executor = Callable[[StepRequest], StepResult]


class Engine:
    def __init__(self, executor: Executor, num_blocks: int, block_size: int, max_context: int,
                 max_num_batched_tokens: int = 512, max_num_seqs: int = 64):
        self.executor = executor
        self.blocks = BlockManager(num_blocks, block_size)
        self.max_context = max_context
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._finished_ids: list[int] = []
        self.num_preemptions = 0                       # since start: sequences sent back to recompute

    def add(self, seq: Sequence) -> None:
        limit = self.max_context
        if seq.num_tokens + (0 if seq.score_top_k and not seq.generate_after_score else 1) > limit:
            raise ValueError(f"prompt has {seq.num_tokens} tokens but the context holds {limit}")
        self.waiting.append(seq)

    def abort(self, seq_id: int) -> None:
        for seq in list(self.waiting) + self.running:
            if seq.seq_id == seq_id:
                seq.finish_reason = "abort"
                self._finish(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ------------------------------------------------------------------------
    def _schedule(self) -> list[tuple[Sequence, int]]:
        """Pick this step's work: decodes first, then running prefills, then new prompts, each
        under the token budget and the free KV blocks. When a running sequence needs a block and
        none is free, the newest running sequence is preempted: its blocks are freed and it goes
        back to the front of the waiting queue, to be recomputed (prompt + output so far) later."""
        budget = self.max_num_batched_tokens
        plan: list[tuple[Sequence, int]] = []
        planned: set[int] = set()
        bs = self.blocks.block_size
        free = self.blocks.num_free

        def need(seq: Sequence, n: int) -> int:
            return max(0, self.blocks.blocks_needed(seq.num_computed + n) - len(seq.block_table))

        def make_room(seq: Sequence, blocks: int) -> bool:
            """Preempt newest-first until `blocks` are free; False when only `seq` itself is left."""
            nonlocal free
            while blocks > free:
                victims = [s for s in self.running if s is not seq and s.seq_id not in planned]
                if not victims:
                    return False
                free += self._preempt(victims[-1])
            return True

        for seq in list(self.running):                 # decodes first: they keep latency low
            if seq not in self.running or budget <= 0:
                continue
            if seq.num_computed == seq.num_tokens - 1:
                k = need(seq, 1)
                if not make_room(seq, k):
                    free += self._preempt(seq)
                    continue
                plan.append((seq, 1))
                planned.add(seq.seq_id)
                free -= k
                budget -= 1
        for seq in list(self.running):                 # then unfinished prefills
            if seq not in self.running or seq.seq_id in planned:
                continue
            remaining = seq.num_tokens - seq.num_computed
            if remaining > 1 or (remaining == 1 and seq.num_computed < len(seq.prompt)):
                if budget <= 0:
                    break
                fits = (len(seq.block_table) + free) * bs - seq.num_computed
                n = min(remaining, budget, fits)
                if n <= 0:
                    continue
                plan.append((seq, n))
                planned.add(seq.seq_id)
                free -= need(seq, n)
                budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            n = min(seq.num_tokens, budget)
            if need(seq, n) > free:
                break
            self.waiting.popleft()
            seq.status = Status.RUNNING
            self.running.append(seq)
            plan.append((seq, n))
            planned.add(seq.seq_id)
            free -= need(seq, n)
            budget -= n
        for seq, n in plan:
            self.blocks.grow(seq.block_table, seq.num_computed + n)
        return plan

    def _preempt(self, seq: Sequence) -> int:
        """Free a running sequence's blocks and queue it for recompute; returns the blocks freed."""
        freed = len(seq.block_table)
        self.blocks.free(seq.block_table)
        self.running.remove(seq)
        seq.num_computed = 0
        seq.prompt_scores.clear()                      # recomputed with the prompt
        seq.status = Status.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
        log.info("KV blocks exhausted: preempted sequence %d (%d tokens, recomputed later; %d preemptions so far)",
                 seq.seq_id, seq.num_tokens, self.num_preemptions)
        return freed

    def step(self) -> list[Sequence]:
        """Run one iteration; returns the sequences that made progress visible to clients."""
        plan = self._schedule()
        if not plan:
            if self.running or self.waiting:
                raise RuntimeError("no sequence could be scheduled: the KV pool is too small for the waiting prompt")
            return []
        chunks = []
        for seq, n in plan:
            start = seq.num_computed
            done_prompt = start + n >= len(seq.prompt)
            chunks.append(SeqChunk(
                seq_id=seq.seq_id,
                token_ids=np.asarray(seq.tokens[start:start + n], np.int64),
                start_pos=start,
                block_table=np.asarray(seq.block_table, np.int32),
                prompt_len=len(seq.prompt),
                sample=done_prompt and start + n == seq.num_tokens and seq.params.max_tokens > 0
                and (not seq.score_top_k or seq.generate_after_score),
                params=seq.params,
                score_top_k=seq.score_top_k if start < len(seq.prompt) else 0,
            ))
        result = self.executor(StepRequest(chunks, finished=self._finished_ids))
        self._finished_ids = []
        by_id = {r.seq_id: r for r in result.results}
        progressed = []
        for (seq, n), chunk in zip(plan, chunks):
            seq.num_computed += n
            r = by_id[seq.seq_id]
            if r.score_ids is not None:
                seq.prompt_scores.extend(zip(r.score_ids, r.score_logprobs))
                if seq.num_computed == seq.num_tokens and not seq.generate_after_score:
                    seq.finish_reason = "scored"
            if chunk.sample:
                seq.append(r.token_id)
                seq.logprobs.append(r.logprob)
                seq.top_logprobs.append((r.top_ids, r.top_logprobs))
                if seq.finish_reason is None and seq.num_tokens >= self.max_context:
                    seq.finish_reason = "length"
            if chunk.sample or seq.finish_reason:
                progressed.append(seq)
            if seq.finish_reason:
                self._finish(seq)
        return progressed

    def _finish(self, seq: Sequence) -> None:
        seq.status = Status.FINISHED
        self.blocks.free(seq.block_table)
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self._finished_ids.append(seq.seq_id)
