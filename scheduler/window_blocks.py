"""Block tables of the sliding-window layers, where the worker keeps them in a pool of their own
(worker/kv_pool.py: a model mixing windowed and full layers, as Gemma 3's five to one).

A sequence's `window_table` runs beside its `block_table`, entry for entry (the same length, grown
together), but an entry whose block holds only positions before the window of the sequence's next
query is released and set to -1: a query at p reads keys p - window < k <= p, so a block that ends
before p - window + 1 is never read again. Full blocks are registered under the same hashes as in
the main pool, so a prompt can start from a cached prefix only where the windowed pool still holds
the blocks the window of its first computed position reads (`usable_hits`); the full layers' blocks
before them are all it needs of the rest. The engine (scheduler/engine.py) counts a new block
against both pools, and releases what left the windows before it plans a step.
"""
from __future__ import annotations

from scheduler.block_manager import BlockManager
from scheduler.block_table import BlockTable
from scheduler.sequence import Sequence

RELEASED = -1


class WindowBlocks:
    def __init__(self, num_blocks: int, block_size: int, window: int, fingerprint: str = ""):
        self.manager = BlockManager(num_blocks, block_size, fingerprint)
        self.window = window
        self.block_size = block_size

    @property
    def num_free(self) -> int:
        return self.manager.num_free

    def first_needed(self, position: int) -> int:
        """The first block a query at `position` reads."""
        return max(0, position - self.window + 1) // self.block_size

    def slide(self, seq: Sequence) -> int:
        """Release the blocks before the window of `seq`'s next position; returns how many."""
        table, first = seq.window_table, min(self.first_needed(seq.num_computed), len(seq.window_table))
        if first <= seq.window_start:
            return 0
        released = self.manager.free([b for b in table[seq.window_start:first] if b >= 0])
        table[seq.window_start:first] = [RELEASED] * (first - seq.window_start)
        seq.window_start = first
        return released

    # ------------------------------------------------------------------ prefix cache
    def usable_hits(self, chain: list[bytes], n_hits: int) -> int:
        """The most of the `n_hits` leading cached blocks a sequence can start after: those whose
        window (the blocks the first position after them reads) this pool holds too."""
        for h in range(n_hits, 0, -1):
            if all(self.manager.lookup([digest]) for digest in chain[self.first_needed(h * self.block_size):h]):
                return h
        return 0

    def hits(self, chain: list[bytes], n_hits: int) -> tuple[int, list[int]]:
        """(first block, its block ids up to n_hits) that a sequence starting after n_hits cached blocks
        takes from this pool."""
        first = self.first_needed(n_hits * self.block_size)
        return first, [self.manager.lookup([digest])[0] for digest in chain[first:n_hits]]

    def block_for(self, digest: bytes | None) -> int | None:
        """This pool's cached block registered under `digest`."""
        found = self.manager.lookup([digest]) if digest is not None else []
        return found[0] if found else None

    # ------------------------------------------------------------------ tables
    def admit(self, seq: Sequence, first: int, hit_ids: list[int]) -> None:
        seq.window_table = BlockTable([RELEASED] * first)
        seq.window_start = first
        self.manager.acquire(seq.window_table, hit_ids)

    def grow(self, seq: Sequence, n_tokens: int) -> None:
        self.manager.grow(seq.window_table, n_tokens)

    def free(self, seq: Sequence) -> None:
        self.manager.free(seq.window_table)
        seq.window_start = 0
