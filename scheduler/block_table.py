"""A sequence's KV block ids: a list the block managers append to, with an int32 array of it kept
in step cheaply. A step sends each running sequence's table; converting a deep sequence's whole list
every step would make the host's work per token grow with the context (16k tokens: a thousand
blocks), while between two steps a table only gains a block now and then, or has a few entries
released (a window sliding). Appends are copied into the array when it is next asked for; any other
change marks the array stale from the first entry it touched."""
from __future__ import annotations

from typing import Iterable, SupportsIndex

import numpy as np


class BlockTable(list):
    def __init__(self, ids: Iterable[int] = ()):
        super().__init__(ids)
        self._array = np.empty(0, np.int32)
        self._synced = 0                     # leading entries the array holds as the list does

    def __reduce__(self):
        """Copies and pickles start with an array of their own (a shared one would be overwritten)."""
        return BlockTable, (list(self),)

    def array(self) -> np.ndarray:
        """The table as a new int32 array (a step may still read it after the table changes)."""
        n = len(self)
        synced = min(self._synced, n)
        if len(self._array) < n:             # room for a while: tables grow a block at a time
            grown = np.empty(max(n, 2 * len(self._array), 64), np.int32)
            grown[:synced] = self._array[:synced]
            self._array = grown
        if synced < n:
            self._array[synced:n] = self[synced:n]
        self._synced = n
        return self._array[:n].copy()

    def _stale_from(self, index: int) -> None:
        self._synced = min(self._synced, max(0, index))

    def _stale_at(self, key: SupportsIndex | slice) -> None:
        if isinstance(key, slice):
            self._stale_from(key.indices(len(self))[0] if key.step in (None, 1) else 0)
        else:
            i = key.__index__()
            self._stale_from(i + len(self) if i < 0 else i)

    # every mutation but append/extend/+= (which only add entries past the synced ones)
    def __setitem__(self, key, value) -> None:
        self._stale_at(key)
        super().__setitem__(key, value)

    def __delitem__(self, key) -> None:
        self._stale_at(key)
        super().__delitem__(key)

    def clear(self) -> None:
        self._synced = 0
        super().clear()

    def pop(self, index: SupportsIndex = -1) -> int:
        self._stale_at(index)
        return super().pop(index)

    def insert(self, index: SupportsIndex, value: int) -> None:
        self._stale_from(min(index.__index__(), len(self)) if index.__index__() >= 0 else 0)
        super().insert(index, value)

    def remove(self, value: int) -> None:
        self._synced = 0
        super().remove(value)

    def reverse(self) -> None:
        self._synced = 0
        super().reverse()

    def sort(self, *args, **kwargs) -> None:
        self._synced = 0
        super().sort(*args, **kwargs)

    def __imul__(self, n: SupportsIndex) -> BlockTable:
        self._synced = 0 if n.__index__() <= 0 else self._synced
        return super().__imul__(n)
