"""Attention of decode rows (one query token per sequence) straight from the paged KV cache.

One task per (row tile, KV head), run in parallel: the group's query heads score every visible key
by walking the block table a block at a time (no gather copy of the context, no padding to the
longest sequence), then softmax (a vectorized exp) and the weighted sum of values. The scores and
the sums are vector kernels (kernels/cpu/key_scores.py, value_sums.py) whose float operations for
a row do not depend on the rows and heads computed with it.
Compiled by numba twice: in parallel (passes of a few rows, whose products run on numba's threads
too) and serial (larger passes, whose products run on OpenBLAS's threads). kernels/cpu/attention.py
keeps a numpy path for machines without numba.

In the passes of 8-bit products (kernels/cpu/int8_matmul.py) every causal row, prompt chunks' too,
is a "decode row" here with its own context length, so no row's result depends on its batch; the
softmax is then rounded to float16 as llama.cpp's f16 V product rounds it, and tasks take row tiles
from both ends in turn, since a chunk's later rows see more keys.

Rows of one sequence at consecutive positions (a prompt chunk's) go ROW_TILE at a time to
row_tile_attention.attend_rows, which decodes each block once for them all. A row that sees
key_parts.SPLIT_KEYS keys or more takes them in two parts (key_parts.split_point), merged: the
replay gives each part to a thread of its own (graph_replay.py).

The pool holds K/V in its codec (kernels/cpu/kv_codecs.py: f16, q8_0 or q4_0), read in place,
never copied whole: f16 keys are converted as the transpose loads them (transpose_half_keys) and
f16 values as the weighted sums load them (weigh_half_pairs); q8_0/q4_0 rows are decoded a block at
a time into a float32 block of the task's own, in L1. A decode row scores GROUPS groups of 16 keys
a call, so that its few query heads (Gemma 3: 4, one KV head) still make enough FMA chains.
"""
from __future__ import annotations

import types

import numpy as np

from kernels.cpu import key_scores, kv_codecs, row_tile_attention, value_sums
from kernels.cpu.key_parts import merge_parts, split_point, weigh_values
from kernels.cpu.key_scores import KEYS
from kernels.cpu.elementwise import round_to_half, row_max, softmax_numerators

GROUPS = 2          # groups of 16 keys a score call of a decode row (attend_part)
AHEAD = 2           # blocks a decode row asks for ahead of their use (kv_codecs.prefetch_block)
ROW_TILE = 16       # rows of one sequence that share each decoded block (decode_attention's sequences)

try:
    from numba import njit, prange
except ImportError:  # pragma: no cover - exercised only where numba is missing
    njit = prange = None


def available() -> bool:
    return njit is not None


def decode_attention(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, tables: np.ndarray,
                     ctx: np.ndarray, scale: float, window: int, parallel: bool = True,
                     half_probabilities: bool = False, sequences: np.ndarray | None = None) -> np.ndarray:
    """q [B, heads, d] -> [B, heads, d]; row b's query sits at position ctx[b] - 1.
    `parallel=False` runs on the calling thread only (passes whose products use OpenBLAS's threads).
    `half_probabilities`: the normalised softmax is rounded to float16 before it weights the values,
    as ggml's CPU backend converts it for the product with an f16 V cache. `sequences`: row b's
    sequence (default: each row its own); rows of one sequence at consecutive positions (a prompt
    chunk's, whose block tables agree) are taken ROW_TILE at a time by attend_rows, each block
    decoded once for them all, each row's result attend's for it alone."""
    ctx = np.ascontiguousarray(ctx, dtype=np.int64)
    starts = row_tiles(np.arange(len(ctx)) if sequences is None else np.asarray(sequences), ctx, ROW_TILE)
    out = np.empty(q.shape, np.float32)
    (_kernel if parallel else _serial_kernel)(np.ascontiguousarray(q, dtype=np.float32), kv_codecs.raw(k_cache),
            kv_codecs.raw(v_cache), kv_codecs.codec_of(k_cache),
            np.ascontiguousarray(tables, dtype=np.int64), ctx, starts,
            np.float32(scale), int(window), bool(half_probabilities), out)
    return out


def row_tiles(sequences: np.ndarray, ctx: np.ndarray, tile: int) -> np.ndarray:
    """Starts of the row tiles (and len(ctx) last): runs of at most `tile` rows of one sequence
    at consecutive positions."""
    n = len(ctx)
    if n == 0:
        return np.zeros(1, np.int64)
    same = np.ones(n, bool)
    same[0] = False
    if n > 1:
        same[1:] = (ctx[1:] == ctx[:-1] + 1) & (sequences[1:] == sequences[:-1])
    run_start = np.maximum.accumulate(np.where(~same, np.arange(n), 0))
    first = ~same | ((np.arange(n) - run_start) % tile == 0)
    return np.append(np.flatnonzero(first), n).astype(np.int64)


def half_queries(q: np.ndarray) -> np.ndarray:
    """q rounded to float16 values in a float32 copy, as the replayed passes round their queries
    (round_to_half: numpy's astype(float16).astype(float32) took 100-164 us for 32 decode rows of
    SmolLM2, twice a layer; the same values below float16's overflow)."""
    out = np.array(q, dtype=np.float32, order="C")
    round_to_half(out.reshape(-1))
    return out


def attend(q, k_cache, v_cache, codec, table, n, scale, window, half, out, b, kv, g0, g1):  # pragma: no cover
    """out[b, h] for the query heads h = kv * (heads per KV head) + g, g0 <= g < g1, the query q[b]
    at position n - 1, reading its keys and values through the block table `table` (int64
    [max_blocks]) from the caches' bytes (kv_codecs.raw, coded by `codec`). Each head is computed
    alone: which heads share a call does not change it (key_scores, value_sums). Rows are indexed,
    not taken as views: a view is a reference count (an atomic add) in the inner loops.
    A row that sees SPLIT_KEYS keys or more takes them in two parts (split_point), merged."""
    dim = q.shape[2]
    first_head = kv * (out.shape[1] // k_cache.shape[0]) + g0   # q may hold more heads after out's (K's)
    group = g1 - g0
    lo = max(0, n - window) if window > 0 else 0
    mid = split_point(n, window, k_cache.shape[2])
    acc = np.empty((2, group, dim), np.float32)
    maxes = np.empty((2, group), np.float32)
    totals = np.empty((2, group), np.float32)
    if mid < 0:
        attend_part(q, k_cache, v_cache, codec, table, lo, n, scale, half, b, kv, first_head, group, acc[0],
                    maxes[0], totals[0])
        for g in range(group):
            inv = np.float32(1.0) if half else np.float32(1.0) / totals[0, g]
            for d in range(dim):
                out[b, first_head + g, d] = acc[0, g, d] * inv
        return
    attend_part(q, k_cache, v_cache, codec, table, lo, mid, scale, half, b, kv, first_head, group, acc[0],
                maxes[0], totals[0])
    attend_part(q, k_cache, v_cache, codec, table, mid, n, scale, half, b, kv, first_head, group, acc[1],
                maxes[1], totals[1])
    for g in range(group):
        merge_parts(acc[:, g], maxes[:, g], totals[:, g], half, out[b, first_head + g])


def attend_part(q, k_cache, v_cache, codec, table, lo, hi, scale, half, b, kv, first_head, group, acc_out,
                maxes, totals):  # pragma: no cover
    """The keys lo <= k < hi of the query q[b] (all visible to it) for its query heads
    first_head <= h < first_head + group, those of KV head kv: acc_out [group, dim] the values weighted by exp(score - maxes[g]), totals[g] the
    sum of those weights; with `half` the weights are first divided by their total and rounded to
    float16 (acc_out then the part's own attention)."""
    dim = q.shape[2]
    block_size = k_cache.shape[2]
    span = hi - lo
    scores = np.empty((group, span), np.float32)
    qs = np.empty((group, dim), np.float32)
    keys = np.empty((block_size, dim), np.float32)       # one block's keys (then values), decoded
    for g in range(group):
        for d in range(dim):
            qs[g, d] = q[b, first_head + g, d] * scale
    first_block, end_block = lo // block_size, (hi + block_size - 1) // block_size
    q_flat, s_flat = qs.reshape(-1), scores.reshape(-1)
    if block_size % KEYS == 0 and dim % KEYS == 0:
        # GROUPS groups of 16 keys a call: a decode row's few query heads alone are too few chains
        keys_t = np.empty((GROUPS, dim, KEYS), np.float32)
        first_group, end_group = lo // KEYS, (hi + KEYS - 1) // KEYS
        for run in range(first_group, end_group, GROUPS):
            count = min(GROUPS, end_group - run)
            for i in range(count):
                key = (run + i) * KEYS
                blk, j16 = key // block_size, key % block_size
                if j16 == 0 and blk + AHEAD < end_block:
                    _prefetch_block(k_cache, kv, table[blk + AHEAD])
                if codec == kv_codecs.F16:
                    _transpose_half_keys(k_cache, kv, table[blk], j16, keys_t, i)
                else:
                    _decode_rows(k_cache, kv, table[blk], j16, j16 + KEYS, codec, keys)
                    _transpose_keys(keys, j16, keys_t[i])
            first_key = run * KEYS
            _score_pairs(q_flat, 0, group, keys_t[:count], s_flat, first_key - lo, span, max(lo - first_key, 0),
                         min(hi - first_key, count * KEYS))
    else:
        for blk in range(first_block, end_block):     # one block's keys at a time
            base = blk * block_size
            j, stop = max(lo, base) - base, min(hi, base + block_size) - base
            _decode_rows(k_cache, kv, table[blk], j, stop, codec, keys)
            for j in range(j, stop):
                for g in range(group):
                    scores[g, base + j - lo] = _score_scalar(q_flat, g * dim, keys, j)
    for blk in range(first_block, min(first_block + AHEAD, end_block)):    # the first values, while the softmax runs
        _prefetch_block(v_cache, kv, table[blk])
    bits = np.empty(span, np.int32)
    for g in range(group):
        maxes[g] = row_max(scores[g])
        totals[g] = softmax_numerators(scores[g], bits)
        if half:
            inv_total = np.float32(1.0) / totals[g]
            for j in range(span):
                scores[g, j] *= inv_total
            round_to_half(scores[g])
    acc_out[:, :] = np.float32(0.0)
    values = keys
    half_values = codec == kv_codecs.F16 and dim % KEYS == 0     # f16 values weighed as they are loaded
    for blk in range(first_block, end_block):
        base = blk * block_size
        j0, stop = max(lo, base) - base, min(hi, base + block_size) - base
        if blk + AHEAD < end_block:
            _prefetch_block(v_cache, kv, table[blk + AHEAD])
        if half_values:
            _weigh_half_pairs(s_flat, base - lo, span, group, v_cache, kv, table[blk], j0, stop, acc_out.reshape(-1), 0)
            continue
        _decode_rows(v_cache, kv, table[blk], j0, stop, codec, values)
        weigh_values(values, j0, stop, scores, base - lo, acc_out)


def _decode_attention(q, k_cache, v_cache, codec, tables, ctx, starts, scale, window, half, out):  # pragma: no cover - numba
    n_tiles = starts.shape[0] - 1
    n_kv = k_cache.shape[0]
    group = q.shape[1] // n_kv
    for task in prange(n_tiles * n_kv):
        # row tiles taken from both ends in turn (0, T-1, 1, T-2, ...): the threads get contiguous
        # ranges of tasks, and a prompt chunk's rows grow in context from first to last
        i = task // n_kv
        t = i // 2 if i % 2 == 0 else n_tiles - 1 - i // 2
        r0, r1 = starts[t], starts[t + 1]
        if r1 - r0 == 1:
            attend(q, k_cache, v_cache, codec, tables[r0], ctx[r0], scale, window, half, out, r0, task % n_kv, 0,
                   group)
        else:
            attend_rows(q, k_cache, v_cache, codec, tables[r0], ctx, scale, window, half, out, r0, r1, task % n_kv,
                        0, group)


if available():
    _decode_rows, _prefetch_block = kv_codecs.decode_rows, kv_codecs.prefetch_block
    _transpose_keys, _score_pairs, _score_scalar = key_scores.transpose_keys, key_scores.score_pairs, key_scores.score_scalar
    _transpose_half_keys, _weigh_half_pairs = key_scores.transpose_half_keys, value_sums.weigh_half_pairs
    attend_part = njit(fastmath=True, cache=True, nogil=True)(attend_part)
    attend = njit(fastmath=True, cache=True, nogil=True)(attend)
    attend_rows = row_tile_attention.attend_rows
_kernel = njit(parallel=True, fastmath=True, cache=True, nogil=True)(_decode_attention) if available() else None
# the same code under another name: numba's on-disk cache is keyed by the function's qualified
# name, and the serial and parallel compilations must not load each other
_serial_source = types.FunctionType(_decode_attention.__code__, _decode_attention.__globals__,
                                    "_decode_attention_serial")
_serial_source.__qualname__ = "_decode_attention_serial"
_serial_kernel = njit(fastmath=True, cache=True, nogil=True)(_serial_source) if available() else None


def warm_up() -> None:
    """Compile (or load from numba's cache) the kernel, so no request waits for it (one signature
    for every codec: the caches travel as their bytes)."""
    if available():
        cache = np.zeros(kv_codecs.pool_shape("f16", 1, 16, 1, 32), np.float16)
        half_queries(np.ones((1, 2, 32), np.float32))
        for parallel in (True, False):
            decode_attention(np.ones((1, 2, 32), np.float32), cache, cache, np.zeros((1, 1), np.int64),
                             np.ones(1, np.int64), 1.0, 0, parallel, True)
