"""Per-sequence backoff of drafting: a sequence whose drafts the model keeps rejecting stops
drafting for a while, on its own, whatever the others in its batch do.

The cost governor (governor.py) decides per range of batch sizes from measured time, which
takes steps to learn and pays a probe in every range a batch passes through; a sequence whose
text simply does not repeat (sampled at a high temperature, or open-ended) says so at its first
verification. After a verification that accepts none of its drafts, the sequence skips drafting
for its next `first_skip` tokens, twice as many after each further fruitless one (up to
`max_skip`); one accepted draft resets it. A sequence backing off neither drafts nor holds the
launch-ahead pipeline (SpeculativeController.holds_pipelining, which with backoff holds it only
once a quarter of the batch may draft), so where the sequences of a batch back off the steps are
the ones speculation off schedules.
"""
from __future__ import annotations

from dataclasses import dataclass

from scheduler.sequence import Sequence


@dataclass
class _Backoff:
    skip: int = 0            # tokens skipped after the last fruitless verification
    resume_at: int = 0       # the output length from which the sequence drafts again


class SequenceBackoff:
    def __init__(self, first_skip: int = 2, max_skip: int = 64):
        if first_skip < 1 or max_skip < first_skip:
            raise ValueError(f"need 1 <= first_skip <= max_skip, got {first_skip}, {max_skip}")
        self.first_skip = first_skip
        self.max_skip = max_skip
        self._held: dict[int, _Backoff] = {}

    def allows(self, seq: Sequence) -> bool:
        """Whether `seq` may draft now (not backing off)."""
        held = self._held.get(seq.seq_id)
        return held is None or len(seq.output) >= held.resume_at

    def verdict(self, seq: Sequence, accepted: int) -> None:
        """A verification of `seq`'s drafts accepted `accepted` of them (before its tokens are
        appended to seq.output)."""
        if accepted > 0:
            self._held.pop(seq.seq_id, None)
            return
        held = self._held.setdefault(seq.seq_id, _Backoff())
        held.skip = self.first_skip if held.skip == 0 else min(self.max_skip, 2 * held.skip)
        held.resume_at = len(seq.output) + 1 + held.skip      # the token this step emits, then skip more

    def backing_off(self) -> int:
        """Sequences that back off now or did at their last verification (for stats)."""
        return len(self._held)

    def forget(self, seq_id: int) -> None:
        self._held.pop(seq_id, None)
