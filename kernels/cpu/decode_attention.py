"""Attention of decode rows (one query token per sequence) straight from the paged KV cache.

One task per (sequence, KV head), run in parallel: the group's query heads
score every visible key by walking the block table a block at a time (no
gather copy of the context, no padding to the longest sequence), then softmax
(a vectorized exp: with numba's scalar exp, 32 sequences at ~40 tokens took
13.4 ms a step instead of 7.3) and
the weighted sum of values. 32 sequences at ~150 tokens: 40 -> 28 ms a step
serial, 22 -> 16 ms parallel (AVX2, 2 cores). Compiled by numba twice: in parallel (passes of a few rows, whose
products run on numba's threads too) and serial (larger passes, whose products
run on OpenBLAS's threads: measured on 2 cores, 32 sequences at ~150 tokens,
44 ms a step against 50 ms for the numpy path, and 2x slower than both when the
parallel kernel meets OpenBLAS's spinning threads). kernels/cpu/attention.py
keeps a numpy path for machines without numba.

In the passes of 8-bit products (kernels/cpu/int8_matmul.py) every causal row,
prompt chunks' too, is a "decode row" here with its own context length, so no
row's result depends on its batch; the softmax is then rounded to float16 as
llama.cpp's f16 V product rounds it, and tasks take rows from both ends in turn,
since a chunk's later rows see more keys (Gemma 3's 512-token prefill attention:
244 -> 164 ms).

The pool holds K/V in its codec (kernels/cpu/kv_codecs.py: f16, q8_0 or q4_0); a task decodes
the keys (then the values) of one block at a time into a float32 block of its own, in L1, and
the sums run over those: quantized blocks are read directly, never copied whole.
"""
from __future__ import annotations

import types

import numpy as np

from kernels.cpu import kv_codecs
from kernels.cpu.elementwise import round_to_half, softmax_numerators

try:
    from numba import njit, prange
except ImportError:  # pragma: no cover - exercised only where numba is missing
    njit = prange = None


def available() -> bool:
    return njit is not None


def decode_attention(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, tables: np.ndarray,
                     ctx: np.ndarray, scale: float, window: int, parallel: bool = True,
                     half_probabilities: bool = False) -> np.ndarray:
    """q [B, heads, d] -> [B, heads, d]; sequence b's query sits at position ctx[b] - 1.
    `parallel=False` runs on the calling thread only (passes whose products use OpenBLAS's threads).
    `half_probabilities`: the normalised softmax is rounded to float16 before it weights the values,
    as ggml's CPU backend converts it for the product with an f16 V cache."""
    out = np.empty(q.shape, np.float32)
    (_kernel if parallel else _serial_kernel)(np.ascontiguousarray(q, dtype=np.float32), kv_codecs.raw(k_cache),
            kv_codecs.raw(v_cache), kv_codecs.codec_of(k_cache),
            np.ascontiguousarray(tables, dtype=np.int64), np.ascontiguousarray(ctx, dtype=np.int64),
            np.float32(scale), int(window), bool(half_probabilities), out)
    return out


def half_queries(q: np.ndarray) -> np.ndarray:
    """q rounded to float16 values in a float32 copy, as the replayed passes round their queries
    (round_to_half: numpy's astype(float16).astype(float32) took 100-164 us for 32 decode rows of
    SmolLM2, twice a layer; the same values below float16's overflow)."""
    out = np.array(q, dtype=np.float32, order="C")
    round_to_half(out.reshape(-1))
    return out


def attend(q, k_cache, v_cache, codec, table, n, scale, window, half, out, b, kv, g0, g1, by_four):  # pragma: no cover
    """out[b, h] for the query heads h = kv * (heads per KV head) + g, g0 <= g < g1, the query q[b]
    at position n - 1, reading its keys and values through the block table `table` (int64
    [max_blocks]) from the caches' bytes (kv_codecs.raw, coded by `codec`). Each head is computed alone: which heads share a call does not change it.
    `by_four`: the keys and values taken four at a time (four terms a pass: not the same float
    sums as single keys, so every caller whose results must agree passes the same value; the
    replay takes True too). On the Zen 5 EPYC of docs/BENCHMARKS.md, 512-token prefills were 6-17 %
    faster with it (two runs each way, both models), the replayed decode rows 1-2 % slower
    (in-process A/Bs): their keys come from memory, not from cache. Rows are indexed, not taken as
    views: a view is a reference count (an atomic add) in the inner loops; on an Emerald Rapids Xeon
    9 heads at 60 keys took 25 kcycles with views, 17 without, the same results."""
    dim = q.shape[2]
    first_head = kv * (out.shape[1] // k_cache.shape[0]) + g0   # q may hold more heads after out's (K's)
    group = g1 - g0
    block_size = k_cache.shape[2]
    lo = 0
    if window > 0:
        lo = max(0, n - window)          # keys k with p - window < k <= p, p = n - 1
    span = n - lo
    scores = np.empty((group, span), np.float32)
    qs = np.empty((group, dim), np.float32)
    keys = np.empty((block_size, dim), np.float32)       # one block's keys (then values), decoded
    for g in range(group):
        for d in range(dim):
            qs[g, d] = q[b, first_head + g, d] * scale
    first_block, end_block = lo // block_size, (n + block_size - 1) // block_size
    for blk in range(first_block, end_block):     # one block's keys at a time
        base = blk * block_size
        j, stop = max(lo, base) - base, min(n, base + block_size) - base
        _decode_rows(k_cache, kv, table[blk], j, stop, codec, keys)
        while by_four and j + 4 <= stop:          # four keys a pass over the query: four sums in flight
            at = base + j - lo
            for g in range(group):
                a0 = a1 = a2 = a3 = np.float32(0.0)
                for d in range(dim):
                    qd = qs[g, d]
                    a0 += qd * keys[j, d]
                    a1 += qd * keys[j + 1, d]
                    a2 += qd * keys[j + 2, d]
                    a3 += qd * keys[j + 3, d]
                scores[g, at], scores[g, at + 1], scores[g, at + 2], scores[g, at + 3] = a0, a1, a2, a3
            j += 4
        for j in range(j, stop):
            for g in range(group):
                acc = np.float32(0.0)
                for d in range(dim):
                    acc += qs[g, d] * keys[j, d]
                scores[g, base + j - lo] = acc
    totals = np.empty(group, np.float32)
    bits = np.empty(span, np.int32)
    for g in range(group):
        totals[g] = softmax_numerators(scores[g], bits)
        if half:
            inv_total = np.float32(1.0) / totals[g]
            for j in range(span):
                scores[g, j] *= inv_total
            round_to_half(scores[g])
            totals[g] = np.float32(1.0)
    acc_out = np.zeros((group, dim), np.float32)
    values = keys
    for blk in range(first_block, end_block):
        base = blk * block_size
        j0, stop = max(lo, base) - base, min(n, base + block_size) - base
        _decode_rows(v_cache, kv, table[blk], j0, stop, codec, values)
        for g in range(group):
            j = j0
            while by_four and j + 4 <= stop:      # four values a pass over the accumulator
                at = base + j - lo
                w0, w1, w2, w3 = scores[g, at], scores[g, at + 1], scores[g, at + 2], scores[g, at + 3]
                for d in range(dim):
                    acc_out[g, d] += (w0 * values[j, d] + w1 * values[j + 1, d] + w2 * values[j + 2, d]
                                      + w3 * values[j + 3, d])
                j += 4
            for j in range(j, stop):
                w = scores[g, base + j - lo]
                for d in range(dim):
                    acc_out[g, d] += w * values[j, d]
    for g in range(group):
        inv = np.float32(1.0) / totals[g]
        for d in range(dim):
            out[b, first_head + g, d] = acc_out[g, d] * inv



def _keys_in_block(n, window, base, block_size):  # pragma: no cover - numba
    """For the query at position n - 1: its first visible key, then the rows [j0, stop) of the
    block starting at key `base` that it sees."""
    lo = max(0, n - window) if window > 0 else 0
    return lo, max(lo, base) - base, min(n, base + block_size) - base


def attend_rows(q, k_cache, v_cache, codec, table, ctx, scale, window, half, out, b0, b1, kv, g0, g1,
                by_four):  # pragma: no cover
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
    for blk in range(first_block, end_block):
        base = blk * block_size
        _decode_rows(k_cache, kv, table[blk], max(lo_all, base) - base, min(n_all, base + block_size) - base,
                     codec, keys)
        for r in range(n_rows):
            lo, j, stop = _keys_in_block(ctx[b0 + r], window, base, block_size)
            if j >= stop:
                continue
            row_scores = scores[r]
            at0 = lo - lo_all              # this row's scores start here in row_scores
            while by_four and j + 4 <= stop:
                at = at0 + base + j - lo
                for g in range(group):
                    a0 = a1 = a2 = a3 = np.float32(0.0)
                    for d in range(dim):
                        qd = qs[r, g, d]
                        a0 += qd * keys[j, d]
                        a1 += qd * keys[j + 1, d]
                        a2 += qd * keys[j + 2, d]
                        a3 += qd * keys[j + 3, d]
                    row_scores[g, at], row_scores[g, at + 1], row_scores[g, at + 2], row_scores[g, at + 3] = \
                        a0, a1, a2, a3
                j += 4
            for j in range(j, stop):
                for g in range(group):
                    acc = np.float32(0.0)
                    for d in range(dim):
                        acc += qs[r, g, d] * keys[j, d]
                    row_scores[g, at0 + base + j - lo] = acc
    totals = np.empty((n_rows, group), np.float32)
    for r in range(n_rows):
        n = ctx[b0 + r]
        lo = max(0, n - window) if window > 0 else 0
        span, at0 = n - lo, lo - lo_all
        bits = np.empty(span, np.int32)
        for g in range(group):
            row = scores[r, g, at0:at0 + span]
            totals[r, g] = softmax_numerators(row, bits)
            if half:
                inv_total = np.float32(1.0) / totals[r, g]
                for j in range(span):
                    row[j] *= inv_total
                round_to_half(row)
                totals[r, g] = np.float32(1.0)
    acc_out = np.zeros((n_rows, group, dim), np.float32)
    values = keys
    for blk in range(first_block, end_block):
        base = blk * block_size
        _decode_rows(v_cache, kv, table[blk], max(lo_all, base) - base, min(n_all, base + block_size) - base,
                     codec, values)
        for r in range(n_rows):
            lo, j0, stop = _keys_in_block(ctx[b0 + r], window, base, block_size)
            if j0 >= stop:
                continue
            at0 = lo - lo_all
            for g in range(group):
                weights, acc = scores[r, g], acc_out[r, g]
                j = j0
                while by_four and j + 4 <= stop:
                    at = at0 + base + j - lo
                    w0, w1, w2, w3 = weights[at], weights[at + 1], weights[at + 2], weights[at + 3]
                    for d in range(dim):
                        acc[d] += (w0 * values[j, d] + w1 * values[j + 1, d] + w2 * values[j + 2, d]
                                   + w3 * values[j + 3, d])
                    j += 4
                for j in range(j, stop):
                    w = weights[at0 + base + j - lo]
                    for d in range(dim):
                        acc[d] += w * values[j, d]
    for r in range(n_rows):
        for g in range(group):
            inv = np.float32(1.0) / totals[r, g]
            for d in range(dim):
                out[b0 + r, first_head + g, d] = acc_out[r, g, d] * inv


def _decode_attention(q, k_cache, v_cache, codec, tables, ctx, scale, window, half, out):  # pragma: no cover - numba
    n_seqs = q.shape[0]
    n_kv = k_cache.shape[0]
    for task in prange(n_seqs * n_kv):
        # rows taken from both ends in turn (0, B-1, 1, B-2, ...): the threads get contiguous
        # ranges of tasks, and a prompt chunk's rows grow in context from first to last
        i = task // n_kv
        b = i // 2 if i % 2 == 0 else n_seqs - 1 - i // 2
        attend(q, k_cache, v_cache, codec, tables[b], ctx[b], scale, window, half, out, b, task % n_kv, 0,
               q.shape[1] // n_kv, True)


if available():
    _decode_rows = kv_codecs.decode_rows
    _keys_in_block = njit(inline="always")(_keys_in_block)
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
