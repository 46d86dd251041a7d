"""Grouped-query attention over a paged KV cache.

K/V caches are [n_kv_heads, num_blocks, block_size, head_dim]. Decode rows
(one query token) of all sequences go to the compiled kernel of
kernels/cpu/decode_attention.py, which walks the block tables: on numba's
threads in passes whose products run there too, on the calling thread alone in
passes whose products use OpenBLAS's threads (the two pools must not meet in a
pass); without numba they are computed together over padded, gathered
contexts in numpy. Multi-token rows (prefill chunks, diffusion canvases) go
sequence by sequence through numpy/OpenBLAS over their context decoded from the
pool's codec (f16, q8_0, q4_0: kernels/cpu/kv_codecs.py) into float32 once per
layer call, the only float copy of it; each query tile's masked softmax is
one compiled call (elementwise.tile_softmax) between OpenBLAS's two products.
Sliding window follows llama.cpp: a query at p sees keys k with p - window < k <= p.
"""
from __future__ import annotations

import functools

import numpy as np

from kernels import AttentionMetadata
from kernels.cpu import decode_attention, elementwise, kv_codecs

QUERY_TILE = 128


def paged_attention(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, meta: AttentionMetadata,
                    scale: float, window: int = 0, compiled: bool = True, rowwise: bool = False) -> np.ndarray:
    """`compiled`: decode rows may use the numba kernel (only in passes whose products run on
    numba's threads too, see kernels/cpu/quantized.py). `rowwise`: every causal row, prompt
    chunks' too, goes through that kernel alone, so that a row's result does not depend on the
    rows packed with it (the products' 8-bit coding of their input can turn a 1e-7 difference
    into another code);
    with the rounding of ggml's CPU backend and its f16 KV cache: queries and the softmax in
    float16."""
    if rowwise and meta.causal and decode_attention.available():
        tables, ctx, sequences = meta.row_tables
        return decode_attention.decode_attention(decode_attention.half_queries(q), k_cache, v_cache,
                                                 tables, ctx, scale, window, parallel=compiled,
                                                 half_probabilities=True, sequences=sequences)
    starts = meta.row_starts
    rows, tables, ctx = meta.decode_tables
    if len(rows) == q.shape[0]:                # a pure decode pass: no row gather or scatter
        return _decode_rows(q, k_cache, v_cache, tables, ctx, scale, window, compiled)
    out = np.empty_like(q)
    if len(rows):
        out[rows] = _decode_rows(q[rows], k_cache, v_cache, tables, ctx, scale, window, compiled)
    for i in np.flatnonzero((meta.query_lens != 1) | (not meta.causal)):
        s, n = starts[i], meta.query_lens[i]
        out[s:s + n] = _multi_token(q[s:s + n], k_cache, v_cache, meta.block_tables[i],
                                    int(meta.context_lens[i]), scale, window, meta.causal)
    return out


def dense_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, seq_lens: np.ndarray, scale: float,
                    rows: np.ndarray | None = None) -> np.ndarray:
    """Non-causal attention of each packed sequence over its own rows, in float32 from K/V that
    never enter the pool (a diffusion canvas is recomputed whole every step; llama.cpp's LLaDA and
    Dream graphs keep their K/V in float32 too). Sequence by sequence, so a canvas's result is the
    same whatever canvases are packed with it: one compiled call over every (sequence, head) on
    numba's threads (the diffusion pass's products run there too), else numpy. `rows` (non-decreasing):
    only those query rows' outputs, [len(rows), heads, d] (a diffusion pass's last layer)."""
    if elementwise.available():
        lens = np.ascontiguousarray(seq_lens, dtype=np.int64)
        starts = np.cumsum(lens) - lens
        if rows is None:
            queries = np.arange(int(lens.sum()), dtype=np.int64)
            first = starts
        else:
            queries = np.ascontiguousarray(rows, dtype=np.int64)
            first = np.searchsorted(queries, starts)
        out = np.empty((len(queries),) + q.shape[1:], np.float32)
        _dense_kernel(np.ascontiguousarray(q, dtype=np.float32), np.ascontiguousarray(k, dtype=np.float32),
                      np.ascontiguousarray(v, dtype=np.float32), starts, lens, queries,
                      np.append(first, len(queries)).astype(np.int64), np.float32(scale), out)
        return out
    if rows is not None:
        return dense_attention(q, k, v, seq_lens, scale)[rows]
    n_heads, dim = q.shape[1], q.shape[2]
    n_kv = k.shape[1]
    group = n_heads // n_kv
    out = np.empty_like(q)
    start = 0
    for n in (int(x) for x in seq_lens):
        qs = q[start:start + n].reshape(n, n_kv, group, dim).transpose(1, 2, 0, 3).reshape(n_kv, group * n, dim)
        scores = np.matmul(qs, k[start:start + n].transpose(1, 2, 0))          # [kv, group * n, n]
        scores *= np.float32(scale)
        _softmax_inplace(scores)
        acc = np.matmul(scores, v[start:start + n].transpose(1, 0, 2))          # [kv, group * n, d]
        out[start:start + n] = acc.reshape(n_kv, group, n, dim).transpose(2, 0, 1, 3).reshape(n, n_heads, dim)
        start += n
    return out


def _decode_rows(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, tables: np.ndarray, ctx: np.ndarray,
                 scale: float, window: int, compiled: bool) -> np.ndarray:
    if not decode_attention.available():
        return _decode(q, k_cache, v_cache, tables, ctx, scale, window)
    # on numba's threads in compiled passes, else on this thread alone (OpenBLAS's are spinning)
    return decode_attention.decode_attention(q, k_cache, v_cache, tables, ctx, scale, window, parallel=compiled)


def _gather(cache: np.ndarray, blocks: np.ndarray) -> np.ndarray:
    """cache[:, blocks] as float32 [kv, *blocks.shape, block_size, d], indexing the first axis only
    (numpy's fast path); for the f16 pool without numba."""
    n_kv, n_blocks = cache.shape[:2]
    index = blocks[None] + (np.arange(n_kv) * n_blocks).reshape((n_kv,) + (1,) * blocks.ndim)
    return cache.reshape(n_kv * n_blocks, *cache.shape[2:])[index].astype(np.float32)


@functools.lru_cache(maxsize=64)
def _mask_bias(first_query: int, n_queries: int, n_keys: int, window: int) -> np.ndarray:
    """0 / -inf bias for queries at key offsets first_query.. over keys 0..n_keys-1 (shared by all layers)."""
    query_pos = first_query + np.arange(n_queries)
    key_pos = np.arange(n_keys)
    visible = key_pos[None, :] <= query_pos[:, None]
    if window > 0:
        visible &= key_pos[None, :] > (query_pos - window)[:, None]
    bias = np.where(visible, np.float32(0), np.float32(-np.inf))
    bias.flags.writeable = False
    return bias


def _softmax_inplace(s: np.ndarray) -> np.ndarray:
    s -= s.max(axis=-1, keepdims=True)
    np.exp(s, out=s)
    s /= s.sum(axis=-1, keepdims=True)
    return s


def _decode(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, tables: np.ndarray,
            ctx: np.ndarray, scale: float, window: int) -> np.ndarray:
    n_seqs, n_heads, dim = q.shape
    n_kv, block_size = k_cache.shape[0], k_cache.shape[2]
    group = n_heads // n_kv
    first_block = 0
    if window > 0:  # blocks wholly before every sequence's window are never read
        first_block = int(max(0, (ctx.min() - window) // block_size))
    last_block = -(-int(ctx.max()) // block_size)
    blocks = tables[:, first_block:last_block]
    span = blocks.shape[1] * block_size
    keys = _gather(k_cache, blocks).reshape(n_kv, n_seqs, span, dim)                   # [kv, B, L, d]
    values = _gather(v_cache, blocks).reshape(n_kv, n_seqs, span, dim)
    qg = (q * np.float32(scale)).reshape(n_seqs, n_kv, group, dim).transpose(1, 0, 2, 3)  # [kv, B, g, d]
    scores = np.matmul(qg, keys.transpose(0, 1, 3, 2))                                 # [kv, B, g, L]
    key_pos = first_block * block_size + np.arange(span)
    query_pos = ctx - 1
    visible = key_pos[None, :] <= query_pos[:, None]
    if window > 0:
        visible &= key_pos[None, :] > (query_pos - window)[:, None]
    scores = np.where(visible[None, :, None, :], scores, np.float32(-np.inf))
    _softmax_inplace(scores)
    return np.matmul(scores, values).transpose(1, 0, 2, 3).reshape(n_seqs, n_heads, dim)


def _context(cache: np.ndarray, blocks: np.ndarray, n_keys: int) -> np.ndarray:
    """Key (or value) positions 0..n_keys-1 of `blocks` in float32, [kv, n_keys, d]: one copy, which
    OpenBLAS reads (views of the pool served only while it held float32)."""
    if kv_codecs.available():
        return kv_codecs.gather(cache, blocks, n_keys)
    return _gather(cache, blocks).reshape(cache.shape[0], -1, cache.shape[3])[:, :n_keys]


def _multi_token(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, table: np.ndarray,
                 ctx: int, scale: float, window: int, causal: bool) -> np.ndarray:
    n_q, n_heads, dim = q.shape
    n_kv, block_size = k_cache.shape[0], k_cache.shape[2]
    group = n_heads // n_kv
    first_pos = ctx - n_q
    lo = 0
    if causal and window > 0:
        lo = max(0, first_pos - window + 1) // block_size
    hi = -(-ctx // block_size)
    base = lo * block_size                     # position of key 0
    n_keys = ctx - base
    blocks = np.asarray(table[lo:hi])
    keys, values = _context(k_cache, blocks, n_keys), _context(v_cache, blocks, n_keys)
    # heads of a KV group share one matmul: rows are (group member, query)
    qg = (q * np.float32(scale)).reshape(n_q, n_kv, group, dim).transpose(1, 2, 0, 3)  # [kv, g, n_q, d]
    out = np.empty((n_kv, group, n_q, dim), np.float32)
    # causal queries are taken in tiles so a tile skips the keys after its last query
    tile = QUERY_TILE if causal else n_q
    bits = np.empty(n_keys, np.int32)           # tile_softmax's scratch
    for a in range(0, n_q, tile):
        b = min(n_q, a + tile)
        t = b - a
        k_lo, k_hi = 0, n_keys
        if causal:
            k_hi = first_pos + b - base
            if window > 0:
                k_lo = max(0, first_pos + a - window + 1 - base)
        qt = qg[:, :, a:b].reshape(n_kv, group * t, dim)
        scores = np.empty((n_kv, group * t, k_hi - k_lo), np.float32)
        np.matmul(qt, keys[:, k_lo:k_hi].transpose(0, 2, 1), out=scores)
        if elementwise.available():
            total = np.empty((n_kv, group * t, 1), np.float32)
            elementwise.tile_softmax(scores.reshape(n_kv * group, t, -1), k_hi - k_lo if causal else -1,
                                     window if causal else 0, bits, total.reshape(n_kv * group, t))
        else:
            if causal:
                s4 = scores.reshape(n_kv, group, t, -1)
                if window > 0:
                    s4 += _mask_bias(first_pos + a - base - k_lo, t, k_hi - k_lo, window)
                else:   # every key before the tile's first query is visible to all of its queries
                    s4[..., -t:] += _mask_bias(0, t, t, 0)
            scores -= scores.max(axis=-1, keepdims=True)
            np.exp(scores, out=scores)
            total = scores.sum(axis=-1, keepdims=True)
        acc = np.matmul(scores, values[:, k_lo:k_hi])
        acc /= total
        out[:, :, a:b] = acc.reshape(n_kv, group, t, dim)
    return out.transpose(2, 0, 1, 3).reshape(n_q, n_heads, dim)


def _dense_rows(q, k, v, starts, lens, queries, first, scale, out):  # pragma: no cover - compiled by numba
    """out[r, h] = softmax(scale * q[i, h] . K^T) V for the query rows i = queries[r] (those of
    sequence s are queries[first[s]:first[s + 1]]) over the rows of i's own sequence, for every
    (sequence, head) in parallel: K and V transposed per sequence and KV head, so that a query's
    scores are a loop across keys and each output a dot product across them, both vectorized."""
    n_heads, dim = q.shape[1], q.shape[2]
    n_kv = k.shape[1]
    group = n_heads // n_kv
    for item in prange(len(lens) * n_heads):
        s_i = item // n_heads
        h = item % n_heads
        kvh = h // group
        start, n = starts[s_i], lens[s_i]
        if first[s_i + 1] == first[s_i]:
            continue
        kt = np.empty((dim, n), np.float32)
        vt = np.empty((dim, n), np.float32)
        for j in range(n):
            for d in range(dim):
                kt[d, j] = k[start + j, kvh, d]
                vt[d, j] = v[start + j, kvh, d]
        scores = np.empty(n, np.float32)
        bits = np.empty(n, np.int32)
        for r in range(first[s_i], first[s_i + 1]):      # no array views in here: each takes a reference
            i = queries[r]
            for j in range(n):
                scores[j] = np.float32(0.0)
            for d in range(dim):
                qd = q[i, h, d] * scale
                for j in range(n):
                    scores[j] += qd * kt[d, j]
            inv = np.float32(1.0) / elementwise.softmax_numerators(scores, bits)
            for d in range(dim):
                acc = np.float32(0.0)
                for j in range(n):
                    acc += scores[j] * vt[d, j]
                out[r, h, d] = acc * inv


if elementwise.available():
    from numba import njit, prange
    _dense_kernel = njit(parallel=True, fastmath=True, cache=True, nogil=True)(_dense_rows)
else:  # pragma: no cover
    prange = range


def warm_up_dense() -> None:
    """Compile (or load from numba's cache) the compiled dense attention."""
    if elementwise.available():
        x = np.ones((2, 2, 4), np.float32)
        dense_attention(x, x[:, :1], x[:, :1], np.array([2]), 0.5)
