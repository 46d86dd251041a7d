"""Grouped-query attention over a paged KV cache, in numpy.

K/V caches are [num_blocks, block_size, n_kv_heads, head_dim]. Decode rows
(one query token) of all sequences are computed together over padded
contexts; multi-token rows (prefill chunks, diffusion canvases) sequence by
sequence. Sliding window follows llama.cpp: a query at p sees keys k with
p - window < k <= p.
"""
from __future__ import annotations

import numpy as np

from kernels import AttentionMetadata


def paged_attention(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray,
                    meta: AttentionMetadata, scale: float, window: int = 0) -> np.ndarray:
    out = np.empty_like(q)
    starts = np.concatenate(([0], np.cumsum(meta.query_lens)[:-1]))
    single = (meta.query_lens == 1) & meta.causal
    if single.any():
        seqs = np.flatnonzero(single)
        out[starts[seqs]] = _decode(q[starts[seqs]], k_cache, v_cache, meta.block_tables[seqs],
                                    meta.context_lens[seqs], scale, window)
    for i in np.flatnonzero(~single):
        s, n = starts[i], meta.query_lens[i]
        out[s:s + n] = _multi_token(q[s:s + n], k_cache, v_cache, meta.block_tables[i],
                                    int(meta.context_lens[i]), scale, window, meta.causal)
    return out


def _softmax_inplace(s: np.ndarray) -> np.ndarray:
    s -= s.max(axis=-1, keepdims=True)
    np.exp(s, out=s)
    s /= s.sum(axis=-1, keepdims=True)
    return s


def _decode(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, tables: np.ndarray,
            ctx: np.ndarray, scale: float, window: int) -> np.ndarray:
    n_seqs, n_heads, dim = q.shape
    block_size, n_kv = k_cache.shape[1], k_cache.shape[2]
    group = n_heads // n_kv
    first_block = 0
    if window > 0:  # blocks wholly before every sequence's window are never read
        first_block = int(max(0, (ctx.min() - window) // block_size))
    last_block = -(-int(ctx.max()) // block_size)
    blocks = tables[:, first_block:last_block]
    span = blocks.shape[1] * block_size
    keys = k_cache[blocks].reshape(n_seqs, span, n_kv, dim).transpose(0, 2, 3, 1)    # [B, kv, d, L]
    values = v_cache[blocks].reshape(n_seqs, span, n_kv, dim).transpose(0, 2, 1, 3)  # [B, kv, L, d]
    qg = q.reshape(n_seqs, n_kv, group, dim) * scale
    scores = np.matmul(qg, keys)                                                      # [B, kv, g, L]
    key_pos = first_block * block_size + np.arange(span)
    query_pos = ctx - 1
    visible = key_pos[None, :] <= query_pos[:, None]
    if window > 0:
        visible &= key_pos[None, :] > (query_pos - window)[:, None]
    scores = np.where(visible[:, None, None, :], scores, -np.inf)
    _softmax_inplace(scores)
    return np.matmul(scores, values).reshape(n_seqs, n_heads, dim)


def _multi_token(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, table: np.ndarray,
                 ctx: int, scale: float, window: int, causal: bool) -> np.ndarray:
    n_q, n_heads, dim = q.shape
    block_size, n_kv = k_cache.shape[1], k_cache.shape[2]
    group = n_heads // n_kv
    first_pos = ctx - n_q
    lo = 0
    if causal and window > 0:
        lo = max(0, first_pos - window + 1) // block_size
    hi = -(-ctx // block_size)
    blocks = table[lo:hi]
    keys = k_cache[blocks].reshape(-1, n_kv, dim)[:ctx - lo * block_size]
    values = v_cache[blocks].reshape(-1, n_kv, dim)[:ctx - lo * block_size]
    key_pos = lo * block_size + np.arange(keys.shape[0])
    # heads of a KV group share one matmul: rows are (group member, query)
    qg = (q * scale).reshape(n_q, n_kv, group, dim).transpose(1, 2, 0, 3).reshape(n_kv, group * n_q, dim)
    scores = np.matmul(qg, keys.transpose(1, 2, 0))                                  # [kv, g*n_q, L]
    if causal:
        query_pos = first_pos + np.arange(n_q)
        visible = key_pos[None, :] <= query_pos[:, None]
        if window > 0:
            visible &= key_pos[None, :] > (query_pos - window)[:, None]
        bias = np.where(visible, np.float32(0), np.float32(-np.inf))
        scores = scores.reshape(n_kv, group, n_q, -1)
        scores += bias
        scores = scores.reshape(n_kv, group * n_q, -1)
    _softmax_inplace(scores)
    out = np.matmul(scores, values.transpose(1, 0, 2))                                # [kv, g*n_q, d]
    return out.reshape(n_kv, group, n_q, dim).transpose(2, 0, 1, 3).reshape(n_q, n_heads, dim)
