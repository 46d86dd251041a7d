"""What a text-diffusion sampler reads off a masked position's logits at temperature 0, in one
compiled pass a row instead of the softmax of the whole vocabulary as arrays: its argmax (the
first, as numpy's), its largest logit, the largest of the others (margin), sum(exp(l - max)) in
float64 of float32 exps as llama.cpp's softmax sums them (the argmax's probability is 1 / that
sum), and sum(exp(l - max) * (l - max)) in float64, from which the entropy follows without a
logarithm a logit (worker/diffusion/base.py). Each row is computed alone, on numba's threads, so a
row's statistics do not depend on the rows beside it. exp is kernels/cpu/elementwise.py's.
"""
from __future__ import annotations

import numpy as np

from kernels.cpu import elementwise, row_matmul

try:
    from numba import njit, prange
except ImportError:  # pragma: no cover - exercised only where numba is missing
    njit = None

CHUNK = 4096        # logits exponentiated at a time (in L1 with their scratch)


def available() -> bool:
    return njit is not None


def _row_stats(logits, rows, need_sum, need_second, need_entropy, argmax, top, second_exp, sums, weighted
               ):  # pragma: no cover - compiled by numba
    vocab = logits.shape[1]
    for i in prange(rows.shape[0]):
        row = logits[rows[i]]
        best = elementwise.row_max(row)
        a = 0
        while row[a] != best:
            a += 1
        argmax[i] = a
        top[i] = best
        if need_second:
            second = -np.inf
            if a > 0:
                second = max(second, elementwise.row_max(row[:a]))
            if a + 1 < vocab:
                second = max(second, elementwise.row_max(row[a + 1:]))
            one = np.empty(1, np.float32)
            one[0] = second if vocab > 1 else best
            elementwise.exp_shifted(one, best, np.empty(1, np.int32))
            second_exp[i] = one[0] if vocab > 1 else np.float32(0.0)
        if need_sum:
            part = np.empty(CHUNK, np.float32)
            bits = np.empty(CHUNK, np.int32)
            total = 0.0
            moments = 0.0
            for start in range(0, vocab, CHUNK):
                n = min(CHUNK, vocab - start)
                chunk = part[:n]
                chunk[:] = row[start:start + n]
                elementwise.exp_shifted(chunk, best, bits)
                for j in range(n):
                    total += np.float64(chunk[j])
                if need_entropy:
                    for j in range(n):
                        moments += np.float64(chunk[j]) * np.float64(row[start + j] - best)
            sums[i] = total
            weighted[i] = moments


_kernel = njit(parallel=True, fastmath=True, cache=True, nogil=True)(_row_stats) if available() else None


def row_stats(logits: np.ndarray, rows: np.ndarray | None, need_sum: bool, need_second: bool, need_entropy: bool
              ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(argmax int64, max float32, exp(second - max) float32, sum(exp) float64,
    sum(exp * (l - max)) float64) of rows `rows` (all where None) of float32 [m, vocab] logits, in
    that order; what is not asked for is 0. Rows must hold finite values."""
    logits = np.ascontiguousarray(logits, dtype=np.float32)
    rows = np.arange(logits.shape[0]) if rows is None else np.ascontiguousarray(rows, dtype=np.int64)
    m = len(rows)
    out = (np.zeros(m, np.int64), np.zeros(m, np.float32), np.zeros(m, np.float32), np.zeros(m, np.float64),
           np.zeros(m, np.float64))
    if m:
        _kernel(logits, rows, need_sum, need_second, need_entropy and need_sum, *out)
    return out


# --- the head's product and the statistics in one pass ---------------------------------------------
# The logits of a step's masked rows, written out ([72, 49153] float32 for 8 canvases, 14 MB) and
# read back, made the product memory-bound (136 GFLOP/s against 209 for 16 rows on a Zen 4's two
# cores). Here each thread takes CHUNK_TILES tiles of the vocabulary at a time, computes every
# row's logits for them into a buffer that stays in L2, and reduces each row there to the chunk's
# statistics; the chunks' statistics are then combined (max and argmax across chunks, sums scaled
# by exp(chunk max - max) in float64). The chunking depends on the vocabulary alone, so a row's
# statistics do not depend on the rows beside it.
CHUNK_TILES = 32        # 1024 logits a row per chunk
PAD = 16


if available() and row_matmul.available():
    _tile_rows_block, _tile_rows1, ROWS = row_matmul._tile_rows_block, row_matmul._tile_rows1, row_matmul.ROWS

    @njit(parallel=True, fastmath=True, cache=True, nogil=True)
    def _head_chunks(x, tiles, vocab, need_sum, need_second, need_entropy, c_max, c_arg, c_second, c_sum, c_mom
                     ):  # pragma: no cover - compiled
        rows = x.shape[0]
        n_tiles = tiles.shape[0]
        n_chunks = c_max.shape[0]
        full = rows // ROWS * ROWS
        for c in prange(n_chunks):
            t0 = c * CHUNK_TILES
            t1 = min(t0 + CHUNK_TILES, n_tiles)
            cols = min((t1 - t0) * row_matmul.TILE, vocab - t0 * row_matmul.TILE)
            # rows PAD floats apart beyond the chunk: 1024 floats are 4 KiB, and rows 4 KiB apart
            # fall in the same L1 sets (stores of 72 rows ran at ~0.6 of the rate of 16)
            buf = np.empty((rows, cols + PAD), np.float32)
            sub = tiles[t0:t1]
            for t in range(t1 - t0):
                for r0 in range(0, full, ROWS):
                    _tile_rows_block(sub, x, buf, t, r0, cols)
                for r0 in range(full, rows):
                    _tile_rows1(sub, x, buf, t, r0, cols)
            part = np.empty(CHUNK, np.float32)
            bits = np.empty(CHUNK, np.int32)
            for r in range(rows):
                row = buf[r, :cols]
                best = elementwise.row_max(row)
                a = 0
                while row[a] != best:
                    a += 1
                c_max[c, r] = best
                c_arg[c, r] = t0 * row_matmul.TILE + a
                if need_second:
                    second = -np.inf
                    if a > 0:
                        second = max(second, elementwise.row_max(row[:a]))
                    if a + 1 < cols:
                        second = max(second, elementwise.row_max(row[a + 1:]))
                    c_second[c, r] = second
                if need_sum:
                    chunk = part[:cols]
                    chunk[:] = row
                    elementwise.exp_shifted(chunk, best, bits)
                    total = 0.0
                    for j in range(cols):
                        total += np.float64(chunk[j])
                    c_sum[c, r] = total
                    if need_entropy:
                        moments = 0.0
                        for j in range(cols):
                            moments += np.float64(chunk[j]) * np.float64(row[j] - best)
                        c_mom[c, r] = moments


def head_stats(x: np.ndarray, w: "row_matmul.RowMatrix", need_sum: bool, need_second: bool, need_entropy: bool
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """`row_stats` of the logits x @ w (w the head, [in, vocab] tiles), without writing them out."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    m, vocab = x.shape[0], w.out_features
    n_chunks = -(-w.tiles.shape[0] // CHUNK_TILES)
    c_max = np.empty((n_chunks, m), np.float32)
    c_arg = np.empty((n_chunks, m), np.int64)
    c_second = np.full((n_chunks, m), -np.inf, np.float32)
    c_sum, c_mom = np.zeros((n_chunks, m), np.float64), np.zeros((n_chunks, m), np.float64)
    if m:
        _head_chunks(x, w.tiles, vocab, need_sum, need_second, need_entropy and need_sum,
                     c_max, c_arg, c_second, c_sum, c_mom)
    top = c_max.max(axis=0)
    first = np.argmax(c_max == top, axis=0)            # the first chunk holding the max: the first argmax
    cols = np.arange(m)
    argmax = c_arg[first, cols]
    second_exp = np.zeros(m, np.float32)
    if need_second:
        others = c_max.copy()
        others[first, cols] = c_second[first, cols]   # the max's chunk offers its runner-up
        second_exp = np.exp(others.max(axis=0).astype(np.float64) - top).astype(np.float32)
    sums, moments = np.zeros(m), np.zeros(m)
    if need_sum:
        shift = c_max.astype(np.float64) - top         # <= 0
        scale = np.exp(shift)
        sums = (c_sum * scale).sum(axis=0)
        if need_entropy:
            moments = (scale * (c_mom + shift * c_sum)).sum(axis=0)
    return argmax, top, second_exp, sums, moments


def warm_up() -> None:
    if available():
        row_stats(np.array([[0.0, 1.0, 1.0, -2.0]], np.float32), None, True, True, True)
        if row_matmul.available():
            head_stats(np.ones((row_matmul.ROWS + 1, 4), np.float32),
                       row_matmul.from_dense(np.ones((4, row_matmul.TILE + 1), np.float32)), True, True, True)
