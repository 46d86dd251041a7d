"""KV blocks out of the pool and back in (`ExportBlocks` / `ImportBlocks`), for prefix
checkpoints: the K and V of a list of blocks, every layer, as one array shaped
[blocks, layers, 2 (K, V), kv_heads, block_size, width] in the pool's codec: float16 values
(width head_dim) for f16, the ggml blocks' bytes (uint8, width = a row's bytes) for q8_0 and
q4_0 (kernels/cpu/kv_codecs.py `wire`). Block-major, so one block's K/V is one contiguous slice:
the block format's payload as it is stored (a restore sends the stored payloads back to back,
and an export's block i is the value to store). The scheduler owns what the blocks mean (their
hashes, tokens and the block format); the worker only copies bytes, after checking that they
fit its pool.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from kernels.cpu import kv_codecs
from worker.kv_pool import KVPool


class BlockTransferError(ValueError):
    """A request whose blocks or arrays do not fit this worker's pool; the message says how."""


def check_block_ids(pool: KVPool, block_ids: Sequence[int]) -> np.ndarray:
    ids = np.asarray(list(block_ids), dtype=np.int64)
    n = pool.capacity.num_blocks
    if ids.size == 0:
        raise BlockTransferError("no block ids given")
    if ((ids < 0) | (ids >= n)).any():
        bad = int(ids[(ids < 0) | (ids >= n)][0])
        raise BlockTransferError(f"block id {bad} is outside this worker's pool [0, {n})")
    if np.unique(ids).size != ids.size:
        raise BlockTransferError("a block id appears twice")
    return ids


def check_window_ids(pool: KVPool, window_ids: Sequence[int] | None, count: int, skips: bool) -> np.ndarray | None:
    """The windowed layers' blocks of a transfer (worker/kv_pool.py): one per block where the pool has
    them (-1: not kept, where `skips`), none otherwise."""
    if not pool.windowed:
        if window_ids:
            raise BlockTransferError("window block ids given, but this worker keeps one pool for every layer")
        return None
    ids = np.asarray(list(window_ids or ()), dtype=np.int64)
    n = pool.capacity.num_window_blocks
    if ids.size != count:
        raise BlockTransferError(f"{count} blocks need {count} window block ids (this worker keeps its "
                                 f"sliding-window layers in a pool of {n} blocks), got {ids.size}")
    kept = ids[ids >= 0] if skips else ids
    if ((kept < 0) | (kept >= n)).any() or np.unique(kept).size != kept.size:
        raise BlockTransferError(f"window block ids must be distinct and lie in [0, {n})")
    return ids


def pool_dtype_name(pool: KVPool) -> str:
    """The pool's codec by name (scheduler/block_format.py's CODEC_DTYPES)."""
    return kv_codecs.name_of(pool.caches[0][0])


def packed_shape(pool: KVPool, num_blocks: int) -> tuple[int, ...]:
    k_cache, _ = pool.caches[0]
    kv_heads, _, block_size, _ = k_cache.shape
    width = kv_codecs.wire(k_cache[:, :0]).shape[3]
    return num_blocks, len(pool.caches), 2, kv_heads, block_size, width


def export_blocks(pool: KVPool, block_ids: Sequence[int], window_ids: Sequence[int] | None = None) -> np.ndarray:
    """A copy of the blocks' K/V, block-major (run on the model thread, between steps); the windowed
    layers' from `window_ids` where they have a pool of their own."""
    ids = check_block_ids(pool, block_ids)
    windowed = check_window_ids(pool, window_ids, ids.size, skips=False)
    out = np.empty(packed_shape(pool, ids.size), kv_codecs.wire(pool.caches[0][0][:, :0]).dtype)
    for layer, (k_cache, v_cache) in enumerate(pool.caches):
        at = windowed if layer in pool.windowed else ids
        out[:, layer, 0] = kv_codecs.wire(k_cache[:, at]).swapaxes(0, 1)
        out[:, layer, 1] = kv_codecs.wire(v_cache[:, at]).swapaxes(0, 1)
    return out


def import_blocks(pool: KVPool, block_ids: Sequence[int], packed: np.ndarray,
                  window_ids: Sequence[int] | None = None) -> None:
    """Writes exported K/V into the given blocks (the windowed layers' into `window_ids`, where they
    have a pool of their own, skipping the blocks given -1 there); nothing is written unless the
    array fits and holds finite values (or block scales)."""
    ids = check_block_ids(pool, block_ids)
    windowed = check_window_ids(pool, window_ids, ids.size, skips=True)
    want = packed_shape(pool, ids.size)
    codec = pool_dtype_name(pool)
    dtype = kv_codecs.wire(pool.caches[0][0][:, :0]).dtype
    if tuple(packed.shape) != want:
        raise BlockTransferError(f"blocks shaped {tuple(packed.shape)}, this pool takes {want} "
                                 "(blocks, layers, 2, kv_heads, block_size, head_dim or a row's bytes)")
    if packed.dtype != dtype:
        raise BlockTransferError(f"dtype {packed.dtype}, this pool ({codec}) holds {dtype}")
    if not kv_codecs.finite_scales(packed, codec):
        raise BlockTransferError("the blocks hold NaN or infinity")
    raw = np.ascontiguousarray(packed).view(np.uint8)        # the pool's bytes, whatever the codec
    kept = np.flatnonzero(windowed >= 0) if windowed is not None else None
    for layer, (k_cache, v_cache) in enumerate(pool.caches):
        if layer in pool.windowed:
            kv_codecs.raw(k_cache)[:, windowed[kept]] = raw[kept, layer, 0].swapaxes(0, 1)
            kv_codecs.raw(v_cache)[:, windowed[kept]] = raw[kept, layer, 1].swapaxes(0, 1)
            continue
        kv_codecs.raw(k_cache)[:, ids] = raw[:, layer, 0].swapaxes(0, 1)
        kv_codecs.raw(v_cache)[:, ids] = raw[:, layer, 1].swapaxes(0, 1)
