"""A sequence's KV block tables across the worker's pools: the main pool (every layer, or the full
layers where the sliding-window ones have a pool of their own) and, where there is one, the windowed
layers' (scheduler/window_blocks.py). The engine asks this for what a step's tables cost and grows,
releases and frees them here; copies of a cached block's first tokens are kept for the next step."""
from __future__ import annotations

from scheduler.block_manager import BlockManager
from scheduler.sequence import Sequence
from scheduler.window_blocks import WindowBlocks


class KVTables:
    def __init__(self, num_blocks: int, block_size: int, fingerprint: str = "", num_window_blocks: int = 0,
                 window: int = 0):
        self.blocks = BlockManager(num_blocks, block_size, fingerprint)
        self.window = WindowBlocks(num_window_blocks, block_size, window, fingerprint) if num_window_blocks else None
        self._copies: list[tuple[int, int]] = []        # KV block copies for the next launched step
        self._copy_sources: list[int] = []              # their source blocks, held until then
        self._window_copies: list[tuple[int, int]] = []  # the same in the windowed layers' pool
        self._window_copy_sources: list[int] = []

    @property
    def num_free(self) -> int:
        """Blocks a new table entry can take: in both pools where the windowed layers have their own."""
        return self.blocks.num_free if self.window is None else min(self.blocks.num_free, self.window.num_free)

    def grow(self, seq: Sequence, n_tokens: int) -> None:
        self.blocks.grow(seq.block_table, n_tokens)
        if self.window is not None:
            self.window.grow(seq, n_tokens)

    def slide(self, seqs: list[Sequence]) -> None:
        """Release the windowed blocks that left the window of each sequence's next position."""
        if self.window is not None:
            for seq in seqs:
                self.window.slide(seq)

    def free(self, seq: Sequence) -> None:
        self.blocks.free(seq.block_table)
        if self.window is not None:
            self.window.free(seq)

    # ------------------------------------------------------------------ admission
    def usable_hits(self, seq: Sequence, hits: list[int]) -> list[int]:
        """The leading cached blocks a sequence can start after: where the windowed layers have a
        pool of their own, it must hold the window after them too."""
        return hits if self.window is None else hits[:self.window.usable_hits(seq.block_hashes, len(hits))]

    def partial_usable(self, partial: tuple[int, int] | None) -> tuple[int, int] | None:
        """A partially shared block (block id, tokens shared), where its windowed copy is cached too."""
        if partial is not None and self.window is not None and self._window_copy_of(partial[0]) is None:
            return None
        return partial

    def admission_cost(self, seq: Sequence, hits: list[int], partial: tuple[int, int] | None, end: int) -> int:
        """Free blocks admitting `seq` from these cached blocks, computing up to `end`, takes (in the
        pool that needs more)."""
        new = self.blocks.blocks_needed(end) - len(hits)
        cost = new + self.blocks.count_unheld(hits + [partial[0]] if partial else hits)
        if self.window is not None:
            _, window_hits = self.window.hits(seq.block_hashes, len(hits))
            held = window_hits + [self._window_copy_of(partial[0])] if partial else window_hits
            cost = max(cost, new + self.window.manager.count_unheld(held))
        return cost

    def admit(self, seq: Sequence, hits: list[int], partial: tuple[int, int] | None) -> None:
        """Take the cached blocks into `seq`'s tables (and a copy of the partially shared block's
        first tokens, made by the next step)."""
        self.blocks.acquire(seq.block_table, hits)
        if self.window is not None:
            self.window.admit(seq, *self.window.hits(seq.block_hashes, len(hits)))
        if partial is None:
            return
        src = partial[0]
        self.blocks.acquire(self._copy_sources, [src])      # held until the copy is launched
        self.grow(seq, len(hits) * self.blocks.block_size + 1)
        self._copies.append((src, seq.block_table[-1]))
        if self.window is not None:
            window_src = self._window_copy_of(src)
            self.window.manager.acquire(self._window_copy_sources, [window_src])
            self._window_copies.append((window_src, seq.window_table[-1]))

    def take_copies(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """The block copies for the step being launched (main pool, windowed pool); their sources are
        released (the worker copies them before any later step runs)."""
        copies, window_copies = self._copies, self._window_copies
        self._copies, self._window_copies = [], []
        self.blocks.free(self._copy_sources)
        if self.window is not None:
            self.window.manager.free(self._window_copy_sources)
        return copies, window_copies

    def commit(self, seq: Sequence, full: int) -> None:
        """Register `seq`'s blocks up to `full`, now computed, in the prefix cache of each pool."""
        self.blocks.commit(seq.block_table, seq.block_hashes, seq.num_committed_blocks, full, seq.token_view)
        if self.window is not None:
            self.window.manager.commit(seq.window_table, seq.block_hashes, seq.num_committed_blocks, full,
                                       seq.token_view)

    def _window_copy_of(self, block_id: int) -> int | None:
        return self.window.block_for(self.blocks.blocks[block_id].hash)
