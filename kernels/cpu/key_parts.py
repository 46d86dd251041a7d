"""A decode row's keys in two parts: a row that sees SPLIT_KEYS keys or more takes them in two
(split_point), each with its own softmax maximum and total, merged as flash-decoding merges split
keys (merge_parts), so that two threads can share one long row (graph_replay.py); and the weighted
sum of a decoded block of values (weigh_values), the loop every attention path here shares."""
from __future__ import annotations

import numpy as np

from kernels.cpu import key_scores, value_sums
from kernels.cpu.elementwise import exp_shifted
from kernels.cpu.key_scores import KEYS

SPLIT_KEYS = 4096   # a row that sees this many keys or more takes them in two parts (split_point)

try:
    from numba import njit
except ImportError:  # pragma: no cover - exercised only where numba is missing
    njit = None


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


if njit is not None:
    _weigh_pairs, _fma = value_sums.weigh_pairs, key_scores.fma
    split_point = njit(inline="always")(split_point)
    weigh_values = njit(inline="always")(weigh_values)
    merge_parts = njit(fastmath=True, cache=True, nogil=True)(merge_parts)
