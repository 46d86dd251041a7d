"""The physical KV cache of one worker: per layer, K and V block arrays sized from a memory budget,
holding K/V in the codec of --kv-cache-dtype (f16, q8_0, q4_0: kernels/cpu/kv_codecs.py)."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np

from kernels import Backend
from kernels.cpu import kv_codecs
from shared.model_config import ModelConfig

log = logging.getLogger(__name__)

DEFAULT_CODEC = "f16"   # llama.cpp's default KV type


@dataclass(frozen=True)
class KVCapacity:
    num_blocks: int
    block_size: int
    max_context: int

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size


def bytes_per_block(config: ModelConfig, block_size: int, codec: str = DEFAULT_CODEC) -> int:
    """K and V of one block, every layer, in the codec's own bytes (q8_0: 34 a row of 32 values)."""
    return 2 * config.n_layers * block_size * config.n_kv_heads * kv_codecs.row_bytes(codec, config.head_dim)


def plan_capacity(config: ModelConfig, memory_bytes: int, block_size: int = 16,
                  max_context: int | None = None, codec: str = DEFAULT_CODEC) -> KVCapacity:
    per_block = bytes_per_block(config, block_size, codec)
    num_blocks = memory_bytes // per_block
    context = min(config.context_length, num_blocks * block_size)
    if max_context is not None:
        if max_context > config.context_length:
            raise ValueError(f"--max-context {max_context} exceeds the model's trained context "
                             f"{config.context_length}")
        need = -(-max_context // block_size)
        if need > num_blocks:
            raise ValueError(f"--max-context {max_context} needs {need} KV blocks "
                             f"({need * per_block / 2**20:.0f} MiB) but the KV memory budget of "
                             f"{memory_bytes / 2**20:.0f} MiB holds {num_blocks}; raise --kv-memory or "
                             "lower --max-context")
        context = max_context
    if num_blocks < 1:
        raise ValueError(f"KV memory budget {memory_bytes} bytes is smaller than one block "
                         f"({per_block} bytes); raise --kv-memory")
    cap = KVCapacity(int(num_blocks), block_size, int(context))
    log.info("KV cache: %d blocks x %d tokens (%.1f MiB, %s), max context %d",
             cap.num_blocks, block_size, cap.num_blocks * per_block / 2**20, codec, cap.max_context)
    return cap


class KVPool:
    def __init__(self, config: ModelConfig, capacity: KVCapacity, ops: Backend, codec: str = DEFAULT_CODEC):
        self.capacity = capacity
        self.ops = ops
        self.codec = codec
        t0 = time.perf_counter()
        self.caches = [ops.alloc_kv(capacity.num_blocks, capacity.block_size, config.n_kv_heads, config.head_dim,
                                    codec) for _ in range(config.n_layers)]
        log.info("KV cache allocated (%d layers) in %.2f s", config.n_layers, time.perf_counter() - t0)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy KV blocks src -> dst in every layer (all sources are read before any is written)."""
        if not pairs:
            return
        src = np.array([p[0] for p in pairs], np.int64)
        dst = np.array([p[1] for p in pairs], np.int64)
        for k_cache, v_cache in self.caches:
            self.ops.copy_blocks(k_cache, v_cache, src, dst)
