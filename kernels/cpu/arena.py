"""Weights placed together in large allocations, so that they sit on 2 MiB pages.

numpy asks Linux for transparent huge pages (madvise) on allocations of 4 MiB
and more only, and most layer matrices of the small models are below that
(SmolLM2's 0.4-2.2 MB each): on 4 KiB pages a decode step's stream of ~130 MB
of codes crosses ~32,000 pages. Copied one after another into 64 MiB chunks,
in the order the model prepares them (its execution order), the same step ran
3-6 % faster (SmolLM2, two A/B runs in one process, 2 cores of a Xeon).
"""
from __future__ import annotations

import mmap

import numpy as np

CHUNK = 64 * 2**20
ALIGN = 64
HUGE_PAGE = 2 * 2**20


class HugePageArena:
    def __init__(self, chunk: int = CHUNK):
        self.chunk = chunk
        self._current = np.empty(0, np.uint8)
        self._used = 0

    def _aligned(self, offset: int) -> int:
        """The first offset from `offset` on whose address in the current chunk is 64-byte aligned."""
        base = self._current.ctypes.data
        return -(-(base + offset) // ALIGN) * ALIGN - base

    def place(self, a: np.ndarray) -> np.ndarray:
        """A copy of the contiguous array `a` inside the arena (arrays of a chunk or more keep their own)."""
        if a.nbytes >= self.chunk or a.nbytes == 0:
            return a
        start = self._aligned(self._used)
        if start + a.nbytes > self._current.nbytes:
            self._current = np.empty(self.chunk + ALIGN, np.uint8)
            start = self._aligned(0)
        view = self._current[start:start + a.nbytes].view(a.dtype).reshape(a.shape)
        view[...] = a
        self._used = start + a.nbytes
        return view



def resident_zeros(shape: tuple[int, ...], dtype=np.float32) -> np.ndarray:
    """np.zeros(shape, dtype) with every page in memory now, on 2 MiB pages where Linux gives them
    (a private anonymous mapping of its own, advised for huge pages, from a 2 MiB boundary). For the
    KV pool, as llama.cpp clears its KV buffer when it creates it: left to fault in as prompts reach
    fresh blocks, a 512-token SmolLM2 prefill spent 74-84 ms storing its K/V (5 ms of copies; the
    rest zeroing new pages at ~0.4 GB/s on the Zen 5 VM of docs/BENCHMARKS.md), and decode a fault
    per layer and KV head every 16 tokens. glibc serves a 9 MB array from its heap, where numpy's
    own huge-page advice does not take."""
    nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
    if nbytes < HUGE_PAGE:
        out = np.zeros(shape, dtype)
    else:
        buf = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)   # shared: no THP
        raw = np.frombuffer(buf, np.uint8)
        start = -raw.ctypes.data % HUGE_PAGE      # the mapping starts on a page, so this does too
        if hasattr(buf, "madvise") and hasattr(mmap, "MADV_HUGEPAGE"):
            buf.madvise(mmap.MADV_HUGEPAGE, start, nbytes)
        out = raw[start:start + nbytes].view(dtype).reshape(shape)
    flat = out.reshape(-1).view(np.uint8)
    flat[::mmap.PAGESIZE] = 0                     # one write a page: the kernel zeroes and maps it
    return out
