"""Decode rows of one sequence at consecutive positions (a prompt chunk's, a verification's), ROW_TILE
at a time (kernels/cpu/decode_attention.py groups them): each block's keys, then its values, are
decoded or loaded once for every row of the tile, while each row's sums are the ones
decode_attention.attend takes for it alone, so no row's result depends on the rows beside it."""
from __future__ import annotations

import numpy as np

from kernels.cpu import key_scores, kv_codecs, value_sums
from kernels.cpu.elementwise import round_to_half, row_max, softmax_numerators
from kernels.cpu.key_parts import merge_parts, split_point, weigh_values
from kernels.cpu.key_scores import KEYS

try:
    from numba import njit
except ImportError:  # pragma: no cover - exercised only where numba is missing
    njit = None


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


if njit is not None:
    _decode_rows = kv_codecs.decode_rows
    _weigh_pairs = value_sums.weigh_pairs
    _transpose_keys, _score_pairs, _score_scalar = key_scores.transpose_keys, key_scores.score_pairs, key_scores.score_scalar
    _transpose_half_keys, _weigh_half_pairs = key_scores.transpose_half_keys, value_sums.weigh_half_pairs
    _keys_in_block = njit(inline="always")(_keys_in_block)
    _lanes_seen = njit(inline="always")(_lanes_seen)
    _values_seen = njit(inline="always")(_values_seen)
    attend_rows = njit(fastmath=True, cache=True, nogil=True)(attend_rows)
