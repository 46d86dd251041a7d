"""KV blocks out of the pool and back in (`ExportBlocks` / `ImportBlocks`), for prefix
checkpoints: the K and V of a list of blocks, every layer, one array a layer shaped
[2 (K, V), kv_heads, blocks, block_size, width] in the pool's codec: float16 values (width
head_dim) for f16, the ggml blocks' bytes (uint8, width = a row's bytes) for q8_0 and q4_0
(kernels/cpu/kv_codecs.py `wire`). The scheduler owns
what the blocks mean (their hashes, tokens and the block format); the worker only copies bytes,
after checking that they fit its pool."""
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


def pool_dtype_name(pool: KVPool) -> str:
    """The pool's codec by name (scheduler/block_format.py's CODEC_DTYPES)."""
    return kv_codecs.name_of(pool.caches[0][0])


def layer_shape(pool: KVPool, num_blocks: int) -> tuple[int, ...]:
    k_cache, _ = pool.caches[0]
    kv_heads, _, block_size, _ = k_cache.shape
    return 2, kv_heads, num_blocks, block_size, kv_codecs.wire(k_cache[:, :0]).shape[3]


def export_blocks(pool: KVPool, block_ids: Sequence[int]) -> list[np.ndarray]:
    """Copies of the blocks' K/V, one array a layer (run on the model thread, between steps)."""
    ids = check_block_ids(pool, block_ids)
    return [kv_codecs.wire(np.stack([k_cache[:, ids], v_cache[:, ids]])) for k_cache, v_cache in pool.caches]


def import_blocks(pool: KVPool, block_ids: Sequence[int], layers: Sequence[np.ndarray]) -> None:
    """Writes exported K/V into the given blocks; nothing is written unless every array fits."""
    ids = check_block_ids(pool, block_ids)
    if len(layers) != len(pool.caches):
        raise BlockTransferError(f"{len(layers)} layer arrays for a model of {len(pool.caches)} layers")
    want = layer_shape(pool, ids.size)
    codec = pool_dtype_name(pool)
    dtype = kv_codecs.wire(pool.caches[0][0][:, :0]).dtype
    for i, array in enumerate(layers):
        if tuple(array.shape) != want:
            raise BlockTransferError(f"layer {i}: shape {tuple(array.shape)}, this pool takes {want} "
                                     "(2, kv_heads, blocks, block_size, head_dim or a row's bytes)")
        if array.dtype != dtype:
            raise BlockTransferError(f"layer {i}: dtype {array.dtype}, this pool ({codec}) holds {dtype}")
        if not kv_codecs.finite_scales(array, codec):
            raise BlockTransferError(f"layer {i}: holds NaN or infinity")
    for (k_cache, v_cache), array in zip(pool.caches, layers):
        blocks = kv_codecs.from_wire(array, codec)
        k_cache[:, ids] = blocks[0]
        v_cache[:, ids] = blocks[1]
