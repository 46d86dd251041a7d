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
attend_rows, which decodes each block once for them all. A row that sees SPLIT_KEYS keys or more
takes them in two parts (split_point), each with its own softmax maximum and total, merged
(merge_parts): the replay gives each part to a thread of its own (graph_replay.py).

The pool holds K/V in its codec (kernels/cpu/kv_codecs.py: f16, q8_0 or q4_0), read in place,
never copied whole: f16 keys are converted as the transpose loads them (transpose_half_keys) and
f16 values as the weighted sums load them (weigh_half_pairs); q8_0/q4_0 rows are decoded a block at
a time into a float32 block of the task's own, in L1. A decode row scores GROUPS groups of 16 keys
a call, so that its few query heads (Gemma 3: 4, one KV head) still make enough FMA chains.
"""
from __future__ import annotations

import types

import numpy as np

from kernels.cpu import key_scores, kv_codecs, value_sums
from kernels.cpu.key_scores import KEYS
from kernels.cpu.elementwise import exp_shifted, round_to_half, row_max, softmax_numerators

SPLIT_KEYS = 4096   # a row that sees this many keys or more takes them in two parts (split_point)
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


def split_point(n, window, block_size):  # pragma: no cover - numba
    """The first key of the second part of the keys seen by the query at position n - 1, or -1
    where it takes them in one. Long rows are split so that two threads can share one row's keys
    (Gemma 3 has one KV head: split by query heads, both threads read every key); the split is
    a function of the row alone, so every path (a row alone or batched, replayed or not,
    verification rows) sums the same parts. At a block boundary: a part's 16-key vectors are
    then those of the whole row."""
    lo = max(0, n - window) if window > 0 else 0
    if n - lo < SPLIT_KEYS:
        return -1
    return (lo + (n - lo) // 2) // block_size * block_size


def merge_parts(acc, maxes, totals, half, out):  # pragma: no cover - numba
    """out[:] = one head's attention from its two parts' states (acc [2, dim], maxes [2], totals
    [2]: attend_part's), as flash-decoding merges split keys: each part rescaled by exp(its
    maximum - the larger one). With `half` a part's acc is already divided by its total."""
    top = max(maxes[0], maxes[1])
    scales = np.empty(2, np.float32)
    scales[0], scales[1] = maxes[0], maxes[1]
    exp_shifted(scales, top, np.empty(2, np.int32))
    denominator = totals[0] * scales[0] + totals[1] * scales[1]
    w0, w1 = scales[0], scales[1]
    if half:
        w0, w1 = totals[0] * scales[0], totals[1] * scales[1]
    inv = np.float32(1.0) / denominator
    for d in range(out.shape[0]):
        out[d] = (acc[0, d] * w0 + acc[1, d] * w1) * inv


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


def weigh_values(values, j0, stop, weights, w_at, acc):  # pragma: no cover - numba
    """acc[g] += weights[g, w_at + j] * values[j] for every head g and the rows j0 <= j < stop of
    a decoded block of values: each lane one chain of FMAs in key order (value_sums.weigh_pairs;
    heads whose size is not a multiple of 16 take the same chains a value at a time)."""
    group, dim = acc.shape
    if dim % KEYS == 0:
        _weigh_pairs(weights.reshape(-1), w_at, weights.shape[1], group, values, j0, stop, acc.reshape(-1), 0)
        return
    for g in range(group):
        for d in range(dim):
            total = acc[g, d]
            for j in range(j0, stop):
                total = _fma(weights[g, w_at + j], values[j, d], total)
            acc[g, d] = total


def _keys_in_block(n, window, base, block_size):  # pragma: no cover - numba
    """For the query at position n - 1: its first visible key, then the rows [j0, stop) of the
    block starting at key `base` that it sees."""
    lo = max(0, n - window) if window > 0 else 0
    return lo, max(lo, base) - base, min(n, base + block_size) - base


def _lanes_seen(n, window, base, block_size, g16):  # pragma: no cover - numba
    """The lanes [first, last) of the 16 keys from key base + g16 that the query at position n - 1 sees."""
    lo, j, stop = _keys_in_block(n, window, base, block_size)
    return max(j, g16) - g16, min(stop, g16 + KEYS) - g16


def _values_seen(n, window, base, block_size):  # pragma: no cover - numba
    """For the query at position n - 1: the rows [j0, stop) of the block starting at key `base`
    that it sees, and the part (split_point) they belong to."""
    mid = split_point(n, window, block_size)
    lo, j0, stop = _keys_in_block(n, window, base, block_size)
    return j0, stop, 1 if 0 <= mid <= base else 0          # mid is a block's first key


def attend_rows(q, k_cache, v_cache, codec, table, ctx, scale, window, half, out, b0, b1, kv, g0, g1):  # pragma: no cover
    """attend for the rows b0 <= b < b1 at once (query b at position ctx[b] - 1), rows whose block
    tables agree on every block they read (`table`: the first row's), as a verification chunk's
    positions of one sequence do: each block's keys, then its values, are decoded once for all of
    them. Each row's sums are attend's own loops over the same keys in the same order, so every
    row's result is the one attend gives it alone (tests/test_decode_attention.py holds them
    bit-identical)."""
    dim = q.shape[2]
    first_head = kv * (out.shape[1] // k_cache.shape[0]) + g0
    group, n_rows = g1 - g0, b1 - b0
    block_size = k_cache.shape[2]
    lo_all, n_all = 1 << 62, 0
    for b in range(b0, b1):
        lo_all = min(lo_all, max(0, ctx[b] - window) if window > 0 else 0)
        n_all = max(n_all, ctx[b])
    scores = np.empty((n_rows, group, n_all - lo_all), np.float32)
    qs = np.empty((n_rows, group, dim), np.float32)
    keys = np.empty((block_size, dim), np.float32)
    for r in range(n_rows):
        for g in range(group):
            for d in range(dim):
                qs[r, g, d] = q[b0 + r, first_head + g, d] * scale
    first_block, end_block = lo_all // block_size, (n_all + block_size - 1) // block_size
    keys_t_one = np.empty((1, dim, KEYS), np.float32)
    keys_t = keys_t_one[0]
    width = n_all - lo_all
    q_flat, s_flat = qs.reshape(-1), scores.reshape(-1)
    vectors = block_size % KEYS == 0 and dim % KEYS == 0
    half_cache = vectors and codec == kv_codecs.F16  # f16 keys (and values) converted as they are loaded
    for blk in range(first_block, end_block):
        base = blk * block_size
        j_all, stop_all = max(lo_all, base) - base, min(n_all, base + block_size) - base
        if not half_cache:
            _decode_rows(k_cache, kv, table[blk], j_all, stop_all, codec, keys)
        if not vectors:
            for r in range(n_rows):
                lo, j, stop = _keys_in_block(ctx[b0 + r], window, base, block_size)
                for j in range(j, stop):
                    for g in range(group):
                        scores[r, g, base + j - lo_all] = _score_scalar(q_flat, (r * group + g) * dim, keys, j)
            continue
        for g16 in range(j_all // KEYS * KEYS, stop_all, KEYS):
            if half_cache:
                _transpose_half_keys(k_cache, kv, table[blk], g16, keys_t_one, 0)
            else:
                _transpose_keys(keys, g16, keys_t)
            r = 0
            while r < n_rows:               # runs of rows that see the same of these 16 keys: one call each
                first, last = _lanes_seen(ctx[b0 + r], window, base, block_size, g16)
                end = r + 1
                while end < n_rows and _lanes_seen(ctx[b0 + end], window, base, block_size, g16) == (first, last):
                    end += 1
                if first < last:
                    _score_pairs(q_flat, r * group * dim, (end - r) * group, keys_t, s_flat,
                                 r * group * width + base + g16 - lo_all, width, first, last)
                r = end
    totals = np.empty((n_rows, 2, group), np.float32)
    maxes = np.empty((n_rows, 2, group), np.float32)
    for r in range(n_rows):
        n = ctx[b0 + r]
        lo = max(0, n - window) if window > 0 else 0
        mid = split_point(n, window, block_size)
        at0 = lo - lo_all
        for part in range(1 if mid < 0 else 2):
            start = at0 if part == 0 else at0 + mid - lo
            stop = at0 + (n - lo if mid < 0 or part == 1 else mid - lo)
            span = stop - start
            bits = np.empty(span, np.int32)
            for g in range(group):
                row = scores[r, g, start:stop]
                maxes[r, part, g] = row_max(row)
                totals[r, part, g] = softmax_numerators(row, bits)
                if half:
                    inv_total = np.float32(1.0) / totals[r, part, g]
                    for j in range(span):
                        row[j] *= inv_total
                    round_to_half(row)
    acc_out = np.zeros((2, n_rows, group, dim), np.float32)
    acc_flat = acc_out.reshape(-1)
    values = keys
    for blk in range(first_block, end_block):
        base = blk * block_size
        if not half_cache:
            _decode_rows(v_cache, kv, table[blk], max(lo_all, base) - base, min(n_all, base + block_size) - base,
                         codec, values)
        r = 0
        while r < n_rows:                   # runs of rows that weigh the same values into the same part
            j0, stop, part = _values_seen(ctx[b0 + r], window, base, block_size)
            end = r + 1
            while end < n_rows and _values_seen(ctx[b0 + end], window, base, block_size) == (j0, stop, part):
                end += 1
            if j0 < stop and half_cache:
                _weigh_half_pairs(s_flat, r * group * width + base - lo_all, width, (end - r) * group, v_cache, kv,
                                  table[blk], j0, stop, acc_flat, (part * n_rows + r) * group * dim)
            elif j0 < stop and dim % KEYS == 0:
                _weigh_pairs(s_flat, r * group * width + base - lo_all, width, (end - r) * group, values, j0, stop,
                             acc_flat, (part * n_rows + r) * group * dim)
            elif j0 < stop:
                for row in range(r, end):
                    weigh_values(values, j0, stop, scores[row], base - lo_all, acc_out[part, row])
            r = end
    for r in range(n_rows):
        if split_point(ctx[b0 + r], window, block_size) >= 0:
            for g in range(group):
                merge_parts(acc_out[:, r, g], maxes[r, :, g], totals[r, :, g], half, out[b0 + r, first_head + g])
            continue
        for g in range(group):
            inv = np.float32(1.0) if half else np.float32(1.0) / totals[r, 0, g]
            for d in range(dim):
                out[b0 + r, first_head + g, d] = acc_out[0, r, g, d] * inv


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
    _keys_in_block = njit(inline="always")(_keys_in_block)
    _lanes_seen = njit(inline="always")(_lanes_seen)
    _values_seen = njit(inline="always")(_values_seen)
    _weigh_pairs, _fma = value_sums.weigh_pairs, key_scores.fma
    _transpose_keys, _score_pairs, _score_scalar = key_scores.transpose_keys, key_scores.score_pairs, key_scores.score_scalar
    _transpose_half_keys, _weigh_half_pairs = key_scores.transpose_half_keys, value_sums.weigh_half_pairs
    split_point = njit(inline="always")(split_point)
    weigh_values = njit(inline="always")(weigh_values)
    merge_parts = njit(fastmath=True, cache=True, nogil=True)(merge_parts)
    attend_part = njit(fastmath=True, cache=True, nogil=True)(attend_part)
    attend = njit(fastmath=True, cache=True, nogil=True)(attend)
    attend_rows = njit(fastmath=True, cache=True, nogil=True)(attend_rows)
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
