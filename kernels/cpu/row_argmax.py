"""A row copied out with its first largest value found on the way (numpy's argmax), for the
logits a replayed decode pass (kernels/cpu/graph_replay.py) hands back with their argmax.

Written on the bits, so that the loops are integer loops, which LLVM vectorizes without
fast-math (a float maximum with its index does not vectorize: 24576 floats took 42 us that
way, 6.5 us this way): each float becomes an int32 key that orders as the float does, with
-0.0 equal to 0.0 as numpy compares them; NaN and infinity are flagged by their exponent.
"""
from __future__ import annotations

import numpy as np

try:
    from numba import njit
except ImportError:  # pragma: no cover - exercised only where numba is missing
    njit = None

BLOCK = 512         # values a vectorized pass takes; the first block that reaches the maximum is searched


def key(u):  # pragma: no cover - compiled
    """An int32 that orders as the float32 whose bits are u (NaN aside), with -0.0 equal to 0.0."""
    sign = u >> 31
    return (u ^ (sign & np.int32(0x7FFFFFFF))) + (sign & np.int32(1))


def _copy_block(src_bits, dst_bits):  # pragma: no cover - compiled
    """dst = src on the bits; the largest key and 1 if a value is NaN or infinite."""
    top, special = np.int32(-2147483648), np.int32(0)
    for j in range(src_bits.shape[0]):
        u = src_bits[j]
        dst_bits[j] = u
        k = key(u)
        top = k if k > top else top
        special |= (u & np.int32(0x7F800000)) == np.int32(0x7F800000)
    return top, special


def copy_with_argmax(src, dst):  # pragma: no cover - compiled
    """dst[:] = src (float32, contiguous, bit for bit); returns (the largest value, the first index
    that holds it, 1 if a value is NaN or infinite else 0); (-inf, 0, 0) for an empty row."""
    n = src.shape[0]
    src_bits, dst_bits = src.view(np.int32), dst.view(np.int32)
    top, top_block, special = np.int32(-2147483648), 0, np.int32(0)
    for b0 in range(0, n, BLOCK):
        block_top, block_special = _copy_block(src_bits[b0:min(b0 + BLOCK, n)], dst_bits[b0:min(b0 + BLOCK, n)])
        special |= block_special
        if block_top > top:
            top, top_block = block_top, b0
    if n == 0:
        return np.float32(-np.inf), 0, 0
    at = top_block
    while at < n - 1 and key(src_bits[at]) != top:
        at += 1
    return src[at], at, int(special)


if njit is not None:
    key = njit(inline="always")(key)
    _copy_block = njit(inline="always")(_copy_block)
    copy_with_argmax = njit(inline="always")(copy_with_argmax)
