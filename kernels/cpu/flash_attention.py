"""Causal attention over the paged KV cache with an online softmax (flash-attention style).

Not wired into the forward passes yet (issue #35): with it, Gemma 3's prompt attention ran ~1.5x
as fast, but its replayed decode steps ran 10-30 % slower than with decode_attention's kernel, and
a model must take one kernel for all its causal rows (mixing them broke tests/test_batching.py's
1e-3 bar). Meant use: where it covers a model's cache (`covers`: f16, heads of 128 values or more, as Gemma 3's 256)
every causal row — a decode row, a verification row, each row of a prompt chunk, in the
kernel-by-kernel passes and the replayed ones alike — is computed by `attend_rows`: its keys are
taken in key tiles of whole blocks (about KEY_TILE_BYTES decoded) aligned to absolute positions;
per tile the row's scores, the running maximum and sum and the weighted values are updated, the
weights rounded to float16 as ggml's CPU backend takes them (llama.cpp's CPU flash path does the
same a key at a time). A row's arithmetic depends only on its query, its context length, the window
and the cache, never on the rows computed with it, so results do not depend on batching or on how
a prompt is chunked. The query heads of a KV head go in pairs: each decoded key is read for two
heads (a key pass was load-bound with one).

Rows of one sequence at consecutive positions are taken ROW_TILE at a time: each key tile is
decoded from the pool's codec once into float32 in L1 and read by all of them, where a row alone
reads the whole context from memory (a prompt chunk at depth 8k read it 512 times). A windowed
layer's rows skip the tiles before their window: a decode row reads only its window's blocks.
Other caches keep decode_attention's two-pass kernel (see `covers` for why).
"""
from __future__ import annotations

import numpy as np

from kernels.cpu import decode_attention, kv_codecs
from kernels.cpu.elementwise import exp_shifted, round_to_half, row_max

try:
    from numba import njit, prange
except ImportError:  # pragma: no cover - exercised only where numba is missing
    njit = prange = None

KEY_TILE_BYTES = 16384   # decoded float32 keys an online-softmax step takes (rounded to whole blocks)
MIN_HEAD_DIM = 128       # smaller heads keep the two-pass kernel (see covers)
ROW_TILE = 16            # query rows of one sequence sharing each decoded key tile


def available() -> bool:
    return njit is not None


def covers(codec: int, head_dim: int) -> bool:
    """Whether causal rows over a cache of this codec and head size take this kernel (prompt and
    decode rows alike, so that a row's bits do not depend on its chunk). Heads of 64 values keep
    decode_attention's two-pass kernel: their per-tile softmax costs as much as the products, and a
    replayed SmolLM2 decode step at depth 4000 spent 10 ms in attention against 5-6.6 ms; the
    quantized caches keep it too: with this kernel Gemma 3 over a q8_0 cache missed one strong
    argmax of llama.cpp's (tests/test_agreement.py) that the two-pass kernel does not."""
    return available() and codec == kv_codecs.F16 and head_dim >= MIN_HEAD_DIM


def attention(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, tables: np.ndarray,
              ctx: np.ndarray, scale: float, window: int, parallel: bool = True,
              sequences: np.ndarray | None = None) -> np.ndarray:
    """q [R, heads, d] -> [R, heads, d]: row r's query sits at position ctx[r] - 1 of the sequence
    sequences[r] (default: each row its own), whose block table is tables[r]. Consecutive rows of
    one sequence at consecutive positions share key tiles. `parallel=False` runs on the calling
    thread only."""
    q = np.ascontiguousarray(q, dtype=np.float32)
    tables = np.ascontiguousarray(tables, dtype=np.int64)
    ctx = np.ascontiguousarray(ctx, dtype=np.int64)
    out = np.empty(q.shape, np.float32)
    starts = row_tiles(np.arange(len(ctx)) if sequences is None else np.asarray(sequences), ctx)
    (_kernel if parallel else _serial_kernel)(q, kv_codecs.raw(k_cache), kv_codecs.raw(v_cache),
                                              kv_codecs.codec_of(k_cache), tables, ctx, starts,
                                              np.float32(scale), int(window), out)
    return out


def row_tiles(sequences: np.ndarray, ctx: np.ndarray) -> np.ndarray:
    """Starts of the row tiles (and len(ctx) last): runs of at most ROW_TILE rows of one sequence
    at consecutive positions."""
    return decode_attention.row_tiles(sequences, ctx, ROW_TILE)


def attend_rows(q, k_cache, v_cache, codec, table, r0, r1, n0, scale, window, out, kv, g0, g1):  # pragma: no cover
    """out[r, h] for rows r0 <= r < r1 (row r at position n0 + r - r0, so it sees n0 + r - r0 + 1
    keys) and the query heads h = kv * group + g, g0 <= g < g1, reading K/V through `table` from
    the caches' bytes (kv_codecs.raw, coded by `codec`). Heads are computed in pairs (0, 1), (2, 3),
    ... of their group, the last alone where the group is odd: a head's arithmetic is the same
    whichever heads are asked for (a replayed pass splits a group's heads between threads), at the
    cost of its partner's where only one of a pair is."""
    dim = q.shape[2]
    group_size = out.shape[1] // k_cache.shape[0]
    e0, e1 = g0 - g0 % 2, min(group_size, g1 + g1 % 2)
    first_head = kv * group_size + e0
    heads = e1 - e0
    rows = r1 - r0
    block_size = k_cache.shape[2]
    # whole blocks, aligned to them; about KEY_TILE_BYTES of decoded keys (in L1 with the values)
    span = max(1, KEY_TILE_BYTES // (4 * dim) // block_size) * block_size
    keys = np.empty((span, dim), np.float32)
    values = np.empty((span, dim), np.float32)
    scores = np.empty((rows, heads, span), np.float32)
    qs = np.empty((rows, heads, dim), np.float32)
    acc = np.zeros((rows, heads, dim), np.float32)
    best = np.full((rows, heads), -np.inf, np.float32)
    total = np.zeros((rows, heads), np.float32)
    rescale = np.empty((rows, heads), np.float32)
    bits = np.empty(span, np.int32)
    for r in range(rows):
        for g in range(heads):
            for d in range(dim):
                qs[r, g, d] = q[r0 + r, first_head + g, d] * scale
    end = n0 + rows                         # keys of the last row: positions < end
    lo = max(0, n0 + 1 - window) if window > 0 else 0   # the first row's first key
    for a in range(lo // span * span, end, span):
        k_lo, k_hi = max(a, lo), min(a + span, end)
        _decode_span(k_cache, kv, table, k_lo, k_hi, a, block_size, codec, keys)
        for r in range(rows):
            n = n0 + r + 1                  # keys this row sees: positions < n, >= n - window
            j0 = max(k_lo, n - window) - a if window > 0 else k_lo - a
            j1 = min(k_hi, n) - a
            if j1 <= j0:                    # nothing of this tile for this row
                continue
            g = 0
            while g + 2 <= heads:           # two heads against four keys a pass: 8 sums, 6 loads
                _pair_scores(qs, keys, scores, r, g, j0, j1, dim)
                g += 2
            if g < heads:
                _one_scores(qs, keys, scores, r, g, j0, j1, dim)
            for g in range(heads):
                tile = scores[r, g, j0:j1]
                top = max(best[r, g], row_max(tile))
                rescale[r, g] = np.exp(best[r, g] - top) if best[r, g] > -np.inf else np.float32(0.0)
                best[r, g] = top
                exp_shifted(tile, top, bits)
                round_to_half(tile)         # the weights in float16, as ggml's CPU backend takes them
                t = np.float32(0.0)
                for j in range(j1 - j0):
                    t += tile[j]
                total[r, g] = total[r, g] * rescale[r, g] + t
        _decode_span(v_cache, kv, table, k_lo, k_hi, a, block_size, codec, values)
        for r in range(rows):
            n = n0 + r + 1
            j0 = max(k_lo, n - window) - a if window > 0 else k_lo - a
            j1 = min(k_hi, n) - a
            if j1 <= j0:
                continue
            for g in range(heads):
                f = rescale[r, g]
                if f != np.float32(1.0):
                    for d in range(dim):
                        acc[r, g, d] *= f
            g = 0
            while g + 2 <= heads:           # two heads' accumulators against four values a pass
                _pair_values(scores, values, acc, r, g, j0, j1, dim)
                g += 2
            if g < heads:
                _one_values(scores, values, acc, r, g, j0, j1, dim)
    for r in range(rows):
        for g in range(g0 - e0, g1 - e0):
            inv = np.float32(1.0) / total[r, g]
            for d in range(dim):
                out[r0 + r, first_head + g, d] = acc[r, g, d] * inv


def _pair_scores(qs, keys, scores, r, g, j0, j1, dim):  # pragma: no cover - numba
    """scores[r, g + i, j] = qs[r, g + i] . keys[j], i < 2, j0 <= j < j1: four keys a pass."""
    j = j0
    while j + 4 <= j1:
        a0 = a1 = a2 = a3 = b0 = b1 = b2 = b3 = np.float32(0.0)
        for d in range(dim):
            qa, qb = qs[r, g, d], qs[r, g + 1, d]
            k0, k1, k2, k3 = keys[j, d], keys[j + 1, d], keys[j + 2, d], keys[j + 3, d]
            a0 += qa * k0
            a1 += qa * k1
            a2 += qa * k2
            a3 += qa * k3
            b0 += qb * k0
            b1 += qb * k1
            b2 += qb * k2
            b3 += qb * k3
        scores[r, g, j], scores[r, g, j + 1], scores[r, g, j + 2], scores[r, g, j + 3] = a0, a1, a2, a3
        scores[r, g + 1, j], scores[r, g + 1, j + 1], scores[r, g + 1, j + 2], scores[r, g + 1, j + 3] = b0, b1, b2, b3
        j += 4
    for j in range(j, j1):
        a0 = b0 = np.float32(0.0)
        for d in range(dim):
            a0 += qs[r, g, d] * keys[j, d]
            b0 += qs[r, g + 1, d] * keys[j, d]
        scores[r, g, j], scores[r, g + 1, j] = a0, b0


def _one_scores(qs, keys, scores, r, g, j0, j1, dim):  # pragma: no cover - numba
    """scores[r, g, j] = qs[r, g] . keys[j], j0 <= j < j1: four keys a pass."""
    j = j0
    while j + 4 <= j1:
        a0 = a1 = a2 = a3 = np.float32(0.0)
        for d in range(dim):
            qd = qs[r, g, d]
            a0 += qd * keys[j, d]
            a1 += qd * keys[j + 1, d]
            a2 += qd * keys[j + 2, d]
            a3 += qd * keys[j + 3, d]
        scores[r, g, j], scores[r, g, j + 1], scores[r, g, j + 2], scores[r, g, j + 3] = a0, a1, a2, a3
        j += 4
    for j in range(j, j1):
        a0 = np.float32(0.0)
        for d in range(dim):
            a0 += qs[r, g, d] * keys[j, d]
        scores[r, g, j] = a0


def _pair_values(scores, values, acc, r, g, j0, j1, dim):  # pragma: no cover - numba
    """acc[r, g + i] += sum_j scores[r, g + i, j] values[j], i < 2, j0 <= j < j1: four values a pass."""
    j = j0
    while j + 4 <= j1:
        a0, a1, a2, a3 = scores[r, g, j], scores[r, g, j + 1], scores[r, g, j + 2], scores[r, g, j + 3]
        b0, b1, b2, b3 = scores[r, g + 1, j], scores[r, g + 1, j + 1], scores[r, g + 1, j + 2], scores[r, g + 1, j + 3]
        for d in range(dim):
            v0, v1, v2, v3 = values[j, d], values[j + 1, d], values[j + 2, d], values[j + 3, d]
            acc[r, g, d] += a0 * v0 + a1 * v1 + a2 * v2 + a3 * v3
            acc[r, g + 1, d] += b0 * v0 + b1 * v1 + b2 * v2 + b3 * v3
        j += 4
    for j in range(j, j1):
        a0, b0 = scores[r, g, j], scores[r, g + 1, j]
        for d in range(dim):
            acc[r, g, d] += a0 * values[j, d]
            acc[r, g + 1, d] += b0 * values[j, d]


def _one_values(scores, values, acc, r, g, j0, j1, dim):  # pragma: no cover - numba
    """acc[r, g] += sum_j scores[r, g, j] values[j], j0 <= j < j1: four values a pass."""
    j = j0
    while j + 4 <= j1:
        a0, a1, a2, a3 = scores[r, g, j], scores[r, g, j + 1], scores[r, g, j + 2], scores[r, g, j + 3]
        for d in range(dim):
            acc[r, g, d] += a0 * values[j, d] + a1 * values[j + 1, d] + a2 * values[j + 2, d] + a3 * values[j + 3, d]
        j += 4
    for j in range(j, j1):
        a0 = scores[r, g, j]
        for d in range(dim):
            acc[r, g, d] += a0 * values[j, d]


def _decode_span(cache, kv, table, k_lo, k_hi, a, block_size, codec, out):  # pragma: no cover - numba
    """out[p - a] = the row at position p, decoded, for k_lo <= p < k_hi (a: the first position of a
    block)."""
    p = k_lo
    while p < k_hi:
        blk = p // block_size
        base = blk * block_size
        stop = min(k_hi, base + block_size)
        _decode_rows(cache, kv, table[blk], p - base, stop - base, codec, out[base - a:])
        p = stop


def _attention(q, k_cache, v_cache, codec, tables, ctx, starts, scale, window, out):  # pragma: no cover - numba
    n_tiles = starts.shape[0] - 1
    n_kv = k_cache.shape[0]
    group = q.shape[1] // n_kv
    for task in prange(n_tiles * n_kv):
        # tiles taken from both ends in turn (0, T-1, 1, T-2, ...): the threads get contiguous
        # ranges of tasks, and a prompt chunk's later rows see more keys
        i = task // n_kv
        t = i // 2 if i % 2 == 0 else n_tiles - 1 - i // 2
        r0, r1 = starts[t], starts[t + 1]
        attend_rows(q, k_cache, v_cache, codec, tables[r0], r0, r1, ctx[r0] - 1, scale, window, out,
                    task % n_kv, 0, group)


if available():
    _decode_rows = kv_codecs.decode_rows
    _decode_span = njit(inline="always")(_decode_span)
    _pair_scores = njit(inline="always", fastmath=True)(_pair_scores)
    _one_scores = njit(inline="always", fastmath=True)(_one_scores)
    _pair_values = njit(inline="always", fastmath=True)(_pair_values)
    _one_values = njit(inline="always", fastmath=True)(_one_values)
    attend_rows = njit(fastmath=True, cache=True, nogil=True)(attend_rows)
    _kernel = njit(parallel=True, fastmath=True, cache=True, nogil=True)(_attention)
    _serial_source = type(_attention)(_attention.__code__, _attention.__globals__, "_attention_serial")
    _serial_source.__qualname__ = "_attention_serial"
    _serial_kernel = njit(fastmath=True, cache=True, nogil=True)(_serial_source)
else:  # pragma: no cover
    _kernel = _serial_kernel = None


def warm_up() -> None:
    """Compile (or load from numba's cache) the kernels (one signature for every codec)."""
    if available():
        cache = np.zeros(kv_codecs.pool_shape("f16", 1, 16, 1, 32), np.float16)
        for parallel in (True, False):
            attention(np.ones((1, 2, 32), np.float32), cache, cache, np.zeros((1, 1), np.int64),
                      np.ones(1, np.int64), 1.0, 0, parallel)
