"""The engine's side of speculative decoding: who drafts how many tokens in a step, and what a
verified chunk leaves of the sequence.

Called from a few points of scheduler/engine.py: `draft` after the step's decodes are planned
(before prompt chunks take the rest of the token budget), `settle` when a chunk with drafts
comes back, `forget` when a sequence leaves, `holds_pipelining` before a step is launched ahead,
`shadow` when one is, `record` with each decode-only step's time. With the governor on, a
sequence whose drafts are all rejected also backs off drafting by itself for a while
(sequence_backoff.py); and drafting runs only for batch sizes where it pays (governor.py): where
the governor has paused it, `draft` drafts nothing and `holds_pipelining` is False, so the step
is the one speculation off would have scheduled. There a cheap proposer (n-gram lookup) is still
asked for one token of one sequence a step, and the governor told whether the model then
produced it (`shadow`): a paused range of batch sizes is probed again as soon as the text turns
copyable, not only after its backoff.
The worker does the arithmetic (it owns sampling): the chunk [last, d1..dk] is verified in the
step's one forward, and it answers with the accepted drafts and one token of its own after them.

Only running decodes draft (not a sequence mid-prefill), never past max_tokens or the context,
never with blocks another sequence would have to be preempted for, and not requests that asked
for logprobs or prompt scores, or that said `speculative: false`.
"""
from __future__ import annotations

from dataclasses import dataclass

from scheduler.block_manager import BlockManager
from scheduler.sequence import Sequence
from scheduler.speculative.base import DraftRequest, Proposer
from scheduler.speculative.draft_length import DraftLength
from scheduler.speculative.governor import CostGovernor
from scheduler.speculative.sequence_backoff import SequenceBackoff
from shared.step import SeqChunk, SeqResult


# With per-sequence backoff, the launch-ahead pipeline is held for drafting only once at least
# 1 / HOLD_SHARE of the running sequences may draft: under 32 streams whose drafts are rejected,
# each sequence coming out of its backoff at its own step would otherwise hold nearly every step.
HOLD_SHARE = 4


@dataclass
class SpeculativeStats:
    drafts: int = 0            # sequence-steps that carried drafted tokens
    draft_tokens: int = 0      # tokens drafted and verified
    accepted_tokens: int = 0   # of those, accepted by the target

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens emitted per verification (accepted drafts + the target's own), vLLM's measure."""
        return 1.0 + self.accepted_tokens / self.drafts if self.drafts else 0.0


class SpeculativeController:
    def __init__(self, proposer: Proposer, num_speculative_tokens: int, governor: CostGovernor | None = None,
                 backoff: SequenceBackoff | None = None, lengths: DraftLength | None = None):
        if num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {num_speculative_tokens}")
        self.proposer = proposer
        self.k = num_speculative_tokens
        self.stats = SpeculativeStats()
        self.governor = governor          # None: always draft
        self.backoff = backoff            # None: a sequence drafts whatever its last verdicts
        self.lengths = lengths            # None: every sequence drafts up to k tokens a step
        self._shadowed: dict[int, tuple[Sequence, int, int]] = {}   # seq_id: (seq, output index, token)
        self._shadow_turn = 0

    @property
    def method(self) -> str:
        return self.proposer.name

    @staticmethod
    def may_draft(seq: Sequence) -> bool:
        """Whether the request lets this sequence draft at all (its state aside)."""
        return seq.speculative and not seq.score_top_k and seq.params.logprobs is None

    def drafting(self, batch_size: int) -> bool:
        """Whether steps of `batch_size` running sequences draft now (the governor's say)."""
        return self.governor is None or self.governor.allows(batch_size)

    def holds_pipelining(self, seqs: list[Sequence]) -> bool:
        """A step launched ahead carries no drafts (its input token is not known yet): while some
        sequence could draft, steps are scheduled one at a time instead. Not where the governor
        has paused drafting for this batch size: there steps pipeline as without speculation."""
        if not self.drafting(len(seqs)):
            return False
        ready = sum(1 for s in seqs if self._may_draft_now(s) and s.params.max_tokens - len(s.output) >= 3)
        if self.backoff is None:
            return ready > 0
        # with backoff, a few sequences ready to draft again do not stop the whole batch's pipeline:
        # they wait (launched-ahead steps carry no drafts) until a share of the batch is ready
        return ready > 0 and ready * HOLD_SHARE >= len(seqs)

    def _may_draft_now(self, seq: Sequence) -> bool:
        return self.may_draft(seq) and (self.backoff is None or self.backoff.allows(seq))

    def record(self, batch_size: int, drafting: bool, emitted: int, seconds: float) -> None:
        """A decode-only step's cost, for the governor (see governor.py for what is measured)."""
        if self.governor is not None:
            self.governor.record(batch_size, drafting, emitted, seconds)

    def draft(self, plan: list[tuple[Sequence, int]], budget: int, free: int, blocks: BlockManager,
              max_context: int, batch_size: int | None = None) -> tuple[int, int]:
        """Give the planned decodes of `plan` drafted tokens (their entries become (seq, 1 + k)),
        within the step's token `budget` and the `free` blocks left after the plan; returns both
        as left over. Blocks are not grown here: the engine grows every planned table after.
        Nothing, at no cost, where the governor has paused drafting for `batch_size` (the running
        sequences; the plan's length when not given)."""
        batch_size = len(plan) if batch_size is None else batch_size
        if not self.drafting(batch_size):
            self.shadow([seq for seq, n in plan if n == 1], batch_size)
            return budget, free
        candidates = []
        for i, (seq, n) in enumerate(plan):
            if n != 1 or seq.num_computed != seq.num_tokens - 1 or not self._may_draft_now(seq):
                continue
            # the target's own token always comes after the drafts: leave room for it
            k = self.k if self.lengths is None else self.lengths.of(seq.seq_id)
            limit = min(k, seq.params.max_tokens - len(seq.output) - 1,
                        max_context - seq.num_tokens - 1)
            if limit > 0:
                candidates.append((i, seq, limit))
        if not candidates or budget <= 0:
            return budget, free
        proposals = self.proposer.propose([DraftRequest(s.seq_id, self._context(s), limit)
                                            for _, s, limit in candidates])
        bs = blocks.block_size
        for (i, seq, limit), drafts in zip(candidates, proposals):
            held = max(len(seq.block_table), blocks.blocks_needed(seq.num_computed + 1))   # with the decode's
            room = (held + free) * bs - (seq.num_computed + 1)
            drafts = [int(t) for t in drafts[:max(0, min(limit, budget, room))]]
            if not drafts:
                continue
            free -= max(0, blocks.blocks_needed(seq.num_computed + 1 + len(drafts)) - held)
            budget -= len(drafts)
            seq.draft_tokens = drafts
            plan[i] = (seq, 1 + len(drafts))
        return budget, free

    def shadow(self, decoding: list[Sequence], batch_size: int) -> None:
        """A step of `batch_size` running sequences decodes `decoding` with drafting paused (planned
        here, or launched ahead by the engine): with a proposer that costs nothing, report the
        outcome of earlier shadow proposals whose token has come, and ask for one token for one of
        these sequences (in turn, so 32 streams cost one lookup a step); no proposal is a miss. A
        proposal reads the tokens known now, so it guesses the output's next token, whether or
        not a step computing it is in flight."""
        if self.governor is None or not self.proposer.cheap or self.drafting(batch_size):
            return
        for seq_id, (seq, at, token) in list(self._shadowed.items()):
            if len(seq.output) > at:
                self.governor.shadow(batch_size, seq.output[at] == token)
                del self._shadowed[seq_id]
        waiting = [s for s in decoding if s.seq_id not in self._shadowed and self._may_draft_now(s)]
        if not waiting:
            return
        self._shadow_turn += 1
        seq = waiting[self._shadow_turn % len(waiting)]
        drafts = self.proposer.propose([DraftRequest(seq.seq_id, self._context(seq), 1)])[0]
        if drafts:
            self._shadowed[seq.seq_id] = (seq, len(seq.output), int(drafts[0]))
        else:
            self.governor.shadow(batch_size, False)

    def _context(self, seq: Sequence) -> list[int]:
        """The tokens of `seq` a proposal reads: its last `context_tokens`, or all of them."""
        keep, n = self.proposer.context_tokens, seq.num_tokens
        return seq.tokens if keep is None else seq.token_slice(max(0, n - keep), n)

    def settle(self, seq: Sequence, chunk: SeqChunk, result: SeqResult) -> int:
        """Count a verified chunk and roll the sequence back to the K/V its kept tokens wrote;
        returns that length (positions [0, it) hold K/V of the sequence's own tokens). The K/V of
        rejected drafts stays in its slots, to be overwritten by the next steps."""
        accepted = len(result.accepted_ids)
        self.stats.drafts += 1
        self.stats.draft_tokens += chunk.num_draft
        self.stats.accepted_tokens += accepted
        if self.backoff is not None:
            self.backoff.verdict(seq, accepted)
        if self.lengths is not None:
            self.lengths.verdict(seq.seq_id, chunk.num_draft, accepted)
        seq.draft_tokens = []
        kept = chunk.start_pos + len(chunk.token_ids) - chunk.num_draft + accepted
        seq.num_computed = min(kept, seq.num_computed)
        return kept

    def forget(self, seq: Sequence) -> None:
        seq.draft_tokens = []
        self._shadowed.pop(seq.seq_id, None)
        self.proposer.forget(seq.seq_id)
        if self.backoff is not None:
            self.backoff.forget(seq.seq_id)
        if self.lengths is not None:
            self.lengths.forget(seq.seq_id)
