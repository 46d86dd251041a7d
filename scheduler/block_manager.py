"""KV block metadata: which physical blocks are free and which sequence holds which."""
from __future__ import annotations

from collections import deque


class OutOfBlocks(RuntimeError):
    pass


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks, self.block_size = num_blocks, block_size
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def blocks_needed(self, n_tokens: int) -> int:
        return -(-n_tokens // self.block_size)

    def can_grow(self, table: list[int], n_tokens: int) -> bool:
        return self.blocks_needed(n_tokens) - len(table) <= len(self._free)

    def grow(self, table: list[int], n_tokens: int) -> None:
        """Append blocks to `table` until it holds `n_tokens` tokens."""
        missing = self.blocks_needed(n_tokens) - len(table)
        if missing > len(self._free):
            raise OutOfBlocks(f"need {missing} KV blocks, {len(self._free)} free")
        for _ in range(missing):
            table.append(self._free.popleft())

    def free(self, table: list[int]) -> None:
        self._free.extend(table)
        table.clear()
