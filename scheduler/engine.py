"""The engine loop: iteration-level scheduling over a paged KV cache with prefix sharing.

Each step packs the running decodes, then unfinished prefills in chunks, then
newly admitted prompts (preempted ones first, then waiting ones, strictly in
arrival order) under a token budget (--max-num-batched-tokens) and a sequence
limit (--max-num-seqs); sends one StepRequest to the worker and folds the
sampled tokens back in. A prompt whose leading full blocks are in the prefix
cache starts after them, and after the first tokens it shares with a cached
block that follows them (in a copy of that block). When a running sequence needs a block and none is
free, the most recently arrived running sequence is preempted: its blocks are
released (they stay in the prefix cache) and it is recomputed later. With prefix checkpoints
(scheduler/checkpoint_tier.py), the blocks a prompt misses in the pool are looked up in the stores
before it is admitted, and its full prompt blocks are written to them as they are computed.
"""
from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable

import numpy as np

from scheduler.checkpoint_tier import CheckpointTier
from scheduler.sequence import Sequence, Status
from scheduler.speculative.controller import SpeculativeController
from scheduler.kv_tables import KVTables
from scheduler.prefix_cache import PrefixCache
from shared.step import SeqChunk, StepRequest, StepResult

log = logging.getLogger(__name__)

Executor = Callable[[StepRequest], StepResult]
Submit = Callable[[StepRequest], Callable[[], StepResult]]   # sends a step; the callable waits for its result
PLACEHOLDER = -1      # a decode token not known yet: the worker uses the one it sampled last


@dataclass
class _Launched:
    plan: list[tuple[Sequence, int]]
    chunks: list[SeqChunk]
    wait: Callable[[], StepResult]
    steps: int = 1
    drafting: bool = False        # scheduled while drafting was on for its batch size
    batch_size: int = 0           # running sequences when it was scheduled


class Engine:
    def __init__(self, executor: Executor, num_blocks: int, block_size: int, max_context: int,
                 max_num_batched_tokens: int = 256, max_num_seqs: int = 64,
                 fingerprint: str = "", enable_prefix_caching: bool = True, submit: Submit | None = None,
                 max_prefill_tokens_while_decoding: int | None = None, num_decode_steps: int = 1,
                 checkpoints: CheckpointTier | None = None, speculative: SpeculativeController | None = None,
                 clock: Callable[[], float] = time.perf_counter, num_window_blocks: int = 0, window: int = 0):
        """`num_window_blocks` > 0: the worker keeps its sliding-window layers (attending over `window`
        tokens) in a pool of their own, addressed by each sequence's window_table
        (scheduler/window_blocks.py)."""
        self.executor = executor
        self.submit = submit
        self._in_flight: _Launched | None = None
        self.tables = KVTables(num_blocks, block_size, fingerprint, num_window_blocks, window)
        self.blocks, self.window = self.tables.blocks, self.tables.window
        self.max_context = max_context
        self.max_num_batched_tokens = max_num_batched_tokens
        # a step that carries decodes takes at most this many prompt tokens: the decodes'
        # inter-token latency is that step's time (vLLM: long_prefill_token_threshold)
        self.max_prefill_tokens_while_decoding = max_prefill_tokens_while_decoding or max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        # a step that only decodes, with nothing waiting, runs up to this many tokens in one worker
        # call (vLLM's multi-step scheduling): the host's work per step is paid once for all of them,
        # and a sequence's tokens reach its client that many at a time
        self.num_decode_steps = max(1, num_decode_steps)
        self.enable_prefix_caching = enable_prefix_caching
        self.waiting: deque[Sequence] = deque()
        self.preempted: list[Sequence] = []            # resumed before any waiting one, oldest first
        self.running: list[Sequence] = []
        self._finished_ids: list[int] = []
        self.num_preemptions = 0                       # since start: sequences sent back to recompute
        self.prefix = PrefixCache(self.tables, enable_prefix_caching, checkpoints)
        self.checkpoints = self.prefix.checkpoints
        self.speculative = speculative                 # drafts for decodes (scheduler/speculative/)
        # step costs for the speculative cost governor: when the last result came back (None while
        # idle), and whether that step only decoded
        self.clock = clock
        self._last_done: float | None = None
        self._last_decode_only = False
        self._drafting = False                         # the step being scheduled may draft

    def add(self, seq: Sequence) -> None:
        limit = self.max_context
        if seq.num_tokens + (0 if seq.score_top_k and not seq.generate_after_score else 1) > limit:
            raise ValueError(f"prompt has {seq.num_tokens} tokens but the context holds {limit}")
        self.waiting.append(seq)

    def abort(self, seq_id: int) -> None:
        for seq in list(self.waiting) + self.preempted + self.running:
            if seq.seq_id == seq_id:
                seq.finish_reason = "abort"
                self._finish(seq)

    @property
    def restored_tokens(self) -> int:
        """Since start: prompt tokens restored from the prefix checkpoint stores."""
        return self.prefix.restored_tokens

    def has_work(self) -> bool:
        return bool(self.waiting or self.preempted or self.running or self._in_flight)

    # ------------------------------------------------------------------------
    def _schedule(self) -> list[tuple[Sequence, int]]:
        budget = self.max_num_batched_tokens
        plan: list[tuple[Sequence, int]] = []
        planned: set[int] = set()
        bs = self.blocks.block_size
        self.tables.slide(self.running)
        free = self.tables.num_free

        def need(seq: Sequence, n: int) -> int:
            return max(0, self.blocks.blocks_needed(seq.num_computed + n) - len(seq.block_table))

        def make_room(seq: Sequence, blocks: int) -> bool:
            """Preempt sequences that arrived after `seq`, newest first, until `blocks` are free;
            False when none is left (an older sequence is never preempted for a newer one)."""
            nonlocal free
            while blocks > free:
                victims = [s for s in self.running if s.arrival > seq.arrival and s.seq_id not in planned]
                if not victims:
                    return False
                free += self._preempt(max(victims, key=lambda s: s.arrival))
            return True

        for seq in sorted(self.running, key=lambda s: s.arrival):   # decodes first: they keep latency low
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
        # the governor's mode for this step: drafting where some sequence could draft (and so holds
        # the pipeline) and the governor lets this batch size draft
        self._drafting = self.speculative is not None and self.speculative.holds_pipelining(self.running)
        if plan and self.speculative is not None:       # drafted tokens ride with the decodes (not where paused)
            budget, free = self.speculative.draft(plan, budget, free, self.blocks, self.max_context,
                                                  len(self.running))
        if plan:
            budget = min(budget, self.max_prefill_tokens_while_decoding)
        for seq in list(self.running):                 # then unfinished prefills, in chunks
            if seq not in self.running or seq.seq_id in planned:
                continue
            remaining = seq.num_tokens - seq.num_computed
            if remaining > 1 or (remaining == 1 and seq.num_computed < len(seq.prompt)):
                if budget <= 0:
                    break
                if (len(seq.block_table) + free) * bs <= seq.num_computed and not make_room(seq, 1):
                    continue                           # waits for older sequences to finish
                fits = (len(seq.block_table) + free) * bs - seq.num_computed
                n = min(remaining, budget, fits)
                plan.append((seq, n))
                planned.add(seq.seq_id)
                free -= need(seq, n)
                budget -= n
        while budget > 0 and len(self.running) < self.max_num_seqs:   # then admit, oldest first
            queue = self.preempted if self.preempted else self.waiting
            if not queue:
                break
            seq = queue[0]
            hits, partial = self.prefix.lookup(seq)
            start = len(hits) * bs + (partial[1] if partial else 0)
            n = min(seq.num_tokens - start, budget)
            cost = self.tables.admission_cost(seq, hits, partial, start + n)
            if cost > free:
                break                                  # no skipping ahead: nobody starves
            queue.remove(seq) if queue is self.preempted else queue.popleft()
            self._admit(seq, hits, partial)
            plan.append((seq, n))
            planned.add(seq.seq_id)
            free -= cost
            budget -= n
        for seq, n in plan:
            self.tables.grow(seq, seq.num_computed + n)
        return plan

    def _admit(self, seq: Sequence, hits: list[int], partial: tuple[int, int] | None = None) -> None:
        self.tables.admit(seq, hits, partial)          # with a copy of a partially shared block's first tokens
        seq.num_committed_blocks = len(hits)            # cached blocks are registered already
        seq.num_computed = len(hits) * self.blocks.block_size + (partial[1] if partial else 0)
        seq.send_prefix = seq.num_computed > 0
        if seq.num_cached_tokens < 0:
            seq.num_cached_tokens = seq.num_computed
            if self.enable_prefix_caching and not seq.score_top_k:
                self.blocks.queried_tokens += len(seq.prompt)
                self.blocks.hit_tokens += seq.num_computed
        seq.status = Status.RUNNING
        self.running.append(seq)

    def _preempt(self, seq: Sequence) -> int:
        """Release a running sequence's blocks and queue it for recompute; returns how many more
        blocks a new table entry can take (num_free)."""
        before = self.tables.num_free
        self.tables.free(seq)
        self.running.remove(seq)
        if self.speculative is not None:
            self.speculative.forget(seq)
        seq.num_computed = seq.num_committed_blocks = 0
        seq.stores_checked = False
        seq.prompt_scores.clear()                      # recomputed with the prompt
        seq.status = Status.PREEMPTED
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.preempted.append(seq)
        self.preempted.sort(key=lambda s: s.arrival)
        log.info("KV blocks exhausted: preempted sequence %d (%d tokens, recomputed later; %d preemptions so far)",
                 seq.seq_id, seq.num_tokens, self.num_preemptions)
        return self.tables.num_free - before

    # ------------------------------------------------------------------------
    def step(self) -> list[Sequence]:
        """Run one iteration; returns the sequences that made progress visible to clients.

        With an asynchronous executor (`submit`), a step that only decodes is followed at
        once by the next one, launched before this one's result is read: its chunks carry
        the placeholder token -1 ("the token you sampled last for this sequence"), so the
        worker never waits for the scheduler between decode steps."""
        self.prefix.release_exported()
        if self._last_done is None:
            self._last_done = self.clock()             # busy from here: the step's cost starts now
        if self._in_flight is None:
            plan = self._schedule()
            if not plan and self.checkpoints is not None and self.checkpoints.holding:
                self.checkpoints.wait_for_release()    # blocks held for a checkpoint's export
                self.prefix.release_exported()
                plan = self._schedule()
            if not plan:
                if self.has_work():
                    raise RuntimeError("no sequence could be scheduled: the KV pool is too small for the "
                                       "waiting prompt")
                self._last_done = None
                return []
            self._in_flight = self._launch(plan, self._decode_steps(plan), self._drafting)
        current = self._in_flight
        ahead = self._plan_ahead(current) if self.submit is not None else None
        self._in_flight = self._launch(ahead) if ahead else None
        progressed = self._fold(current)
        if not self.has_work():
            self._last_done = None                     # idle until the next request
        return progressed

    def _decode_steps(self, plan: list[tuple[Sequence, int]]) -> int:
        """Tokens the planned step decodes in one call (num_decode_steps), its block tables grown for
        them: only when every running sequence decodes, nothing waits to be admitted, and the blocks
        are free; never past a sequence's max_tokens or the context."""
        if self.num_decode_steps <= 1 or self.waiting or self.preempted or len(plan) != len(self.running):
            return 1
        if not all(n == 1 and seq.num_computed == seq.num_tokens - 1 and not seq.score_top_k for seq, n in plan):
            return 1
        steps = min(self.num_decode_steps, *(seq.params.max_tokens - len(seq.output) for seq, _ in plan),
                    *(self.max_context - seq.num_tokens for seq, _ in plan))
        need = sum(max(0, self.blocks.blocks_needed(seq.num_computed + steps) - len(seq.block_table))
                   for seq, _ in plan)
        if steps <= 1 or need > self.tables.num_free:
            return 1
        for seq, _ in plan:
            self.tables.grow(seq, seq.num_computed + steps)
        return steps

    def _launch(self, plan: list[tuple[Sequence, int]], steps: int = 1, drafting: bool = False) -> _Launched:
        chunks = [self._chunk(seq, n) for seq, n in plan]
        copies, window_copies = self.tables.take_copies()
        request = StepRequest(chunks, finished=self._finished_ids, copy_blocks=copies, num_steps=steps,
                              copy_window_blocks=window_copies)
        self._finished_ids = []
        for seq, n in plan:
            seq.num_computed += n + steps - 1          # in flight: the worker is computing them
        if self.submit is not None:
            return _Launched(plan, chunks, self.submit(request), steps, drafting, len(self.running))
        result = self.executor(request)
        return _Launched(plan, chunks, lambda: result, steps, drafting, len(self.running))

    def _plan_ahead(self, current: _Launched) -> list[tuple[Sequence, int]] | None:
        """The next decode step, if it can be decided before `current` returns: `current` only
        decodes, nothing waits to be admitted, and the blocks the next tokens need are free.
        A sequence that `current` surely finishes (max_tokens, context) is left out; one that
        stops on a token it samples there costs a wasted row."""
        if self.waiting or self.preempted or current.steps > 1:
            return None
        if self.speculative is not None and self.speculative.holds_pipelining(self.running):
            return None                                # the next step may draft: it needs this one's token
        if not all(n == 1 and c.sample and not c.score_top_k for (_, n), c in zip(current.plan, current.chunks)):
            return None
        seqs = [seq for seq, _ in current.plan if seq.status is Status.RUNNING]
        if len(seqs) != len(self.running):
            return None                                # someone is mid-prefill: schedule normally
        seqs = [s for s in seqs if len(s.output) + 2 <= s.params.max_tokens and s.num_tokens + 2 <= self.max_context]
        # the windowed blocks the running step still reads are only taken by steps after it
        self.tables.slide(seqs)
        need = sum(max(0, self.blocks.blocks_needed(s.num_computed + 1) - len(s.block_table)) for s in seqs)
        if not seqs or need > self.tables.num_free or len(seqs) > self.max_num_batched_tokens:
            return None
        for s in seqs:
            self.tables.grow(s, s.num_computed + 1)
        if self.speculative is not None:               # drafting is paused here: see if it would pay
            self.speculative.shadow(seqs, len(self.running))
        return [(s, 1) for s in seqs]

    def _fold(self, launched: _Launched) -> list[Sequence]:
        result = launched.wait()
        done = self.clock()
        by_step = [{r.seq_id: r for r in results} for results in [result.results, *result.later]]
        progressed = []
        emitted = 0
        for (seq, n), chunk in zip(launched.plan, launched.chunks):
            if seq.status is Status.FINISHED:          # aborted, or stopped while this step ran
                continue
            had = len(seq.output)
            r = by_step[0][seq.seq_id]
            if r.score_ids is not None:
                targets = r.score_target_logprobs if r.score_target_logprobs is not None \
                    else [None] * len(r.score_ids)
                seq.prompt_scores.extend(zip(r.score_ids, r.score_logprobs, targets))
                if seq.num_computed == seq.num_tokens and not seq.generate_after_score:
                    seq.finish_reason = "scored"
            computed = chunk.start_pos + n + launched.steps - 1
            if chunk.num_draft:                        # accepted drafts, then the target's own token
                computed = self.speculative.settle(seq, chunk, r)
                for token, logprob in zip([*r.accepted_ids, r.token_id], [*r.accepted_logprobs, r.logprob]):
                    if seq.finish_reason is None:      # a stop among the accepted ends it there
                        self._append(seq, token, logprob, None, None)
            elif chunk.sample:
                for by_id in by_step:                  # a multi-step call's tokens up to the sequence's stop
                    if seq.finish_reason is None:
                        r = by_id[seq.seq_id]
                        self._append(seq, r.token_id, r.logprob, r.top_ids, r.top_logprobs)
            emitted += len(seq.output) - had
            # the K/V written for positions whose input token the sequence kept
            self.prefix.commit(seq, min(computed, seq.num_tokens))
            if chunk.sample or seq.finish_reason:
                progressed.append(seq)
            if seq.finish_reason:
                self._finish(seq)
        self._record_cost(launched, emitted, done)
        return progressed

    def _record_cost(self, launched: _Launched, emitted: int, done: float) -> None:
        """Tell the speculative cost governor what a decode-only step cost: the time from the
        previous result to this one, when that previous step only decoded too (the first step
        after a prompt chunk is never launched ahead, whatever the mode). Steps with prompt
        chunks are not measured (scheduler/speculative/governor.py says why)."""
        decode_only = all(c.sample and not c.score_top_k and c.start_pos >= c.prompt_len
                          and len(c.token_ids) == 1 + c.num_draft for c in launched.chunks)
        if (self.speculative is not None and decode_only and self._last_decode_only
                and self._last_done is not None):
            self.speculative.record(launched.batch_size, launched.drafting, emitted, done - self._last_done)
        self._last_done, self._last_decode_only = done, decode_only

    def _append(self, seq: Sequence, token: int, logprob: float, top_ids, top_logprobs) -> None:
        seq.append(token)
        seq.logprobs.append(logprob)
        seq.top_logprobs.append((top_ids, top_logprobs))
        if seq.finish_reason is None and seq.num_tokens >= self.max_context:
            seq.finish_reason = "length"

    def _chunk(self, seq: Sequence, n: int) -> SeqChunk:
        start = seq.num_computed
        done_prompt = start + n >= len(seq.prompt)
        drafts = seq.draft_tokens
        ids = seq.token_slice(start, start + n - len(drafts)) + drafts
        chunk = SeqChunk(
            seq_id=seq.seq_id,
            token_ids=np.asarray(ids + [PLACEHOLDER] * (n - len(ids)), np.int64),   # ahead: being sampled
            start_pos=start,
            block_table=seq.block_table.array(),
            window_table=seq.window_table.array() if self.window is not None else None,
            prompt_len=len(seq.prompt),
            sample=done_prompt and start + n >= seq.num_tokens and seq.params.max_tokens > 0
            and (not seq.score_top_k or seq.generate_after_score),
            params=seq.params,
            score_top_k=seq.score_top_k if start < len(seq.prompt) else 0,
            prefix_ids=np.asarray(seq.token_slice(0, start), np.int64) if seq.send_prefix else None,
            num_draft=len(drafts),
        )
        if chunk.score_top_k:                          # each position's next token, for its own logprob
            nxt = seq.token_slice(start + 1, start + n + 1)
            chunk.score_targets = np.asarray(nxt + [-1] * (n - len(nxt)), np.int64)
        seq.send_prefix = False
        return chunk

    def _finish(self, seq: Sequence) -> None:
        seq.status = Status.FINISHED
        self.tables.free(seq)
        if self.speculative is not None:
            self.speculative.forget(seq)
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.preempted:
            self.preempted.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self._finished_ids.append(seq.seq_id)
