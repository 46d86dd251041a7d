"""How many tokens a sequence drafts next: longer while its drafts are accepted whole, shorter
after they are not (the schedule of Hugging Face's assisted generation: +2 after a verification
that accepts every draft, -1 after one that does not).

A verification pass costs more with every row it carries (on the CPU each row of the 8-bit
products is compute, not a free ride on the weights' stream), so the right length follows the
text: a paragraph being copied accepts everything and pays for the longest drafts; a lookup in
text that is not being copied is usually wrong after its first tokens, where short drafts waste
less. `--num-speculative-tokens` is the ceiling; a sequence starts at `start` (at most that).
"""
from __future__ import annotations


class DraftLength:
    def __init__(self, ceiling: int, start: int = 5, grow: int = 2, shrink: int = 1):
        if ceiling < 1:
            raise ValueError(f"the draft length ceiling must be >= 1, got {ceiling}")
        self.ceiling = ceiling
        self.start = max(1, min(start, ceiling))
        self.grow, self.shrink = grow, shrink
        self._length: dict[int, int] = {}

    def of(self, seq_id: int) -> int:
        """Tokens the sequence drafts at most in its next step."""
        return self._length.get(seq_id, self.start)

    def verdict(self, seq_id: int, drafted: int, accepted: int) -> None:
        length = self.of(seq_id)
        if accepted >= drafted:
            length = min(self.ceiling, length + self.grow)
        else:
            length = max(1, length - self.shrink)
        self._length[seq_id] = length

    def forget(self, seq_id: int) -> None:
        self._length.pop(seq_id, None)
