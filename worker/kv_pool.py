"""The physical KV cache of one worker: per layer, K and V block arrays sized from a memory budget,
holding K/V in the codec of --kv-cache-dtype (f16, q8_0, q4_0: kernels/cpu/kv_codecs.py).

A model whose layers mix sliding-window and full attention (Gemma 3: five windowed layers to one
global) keeps two pools, as llama.cpp's SWA cache does: the full layers' blocks hold every position,
the windowed layers' blocks only the positions still inside some query's window, in a pool of their
own sized for --max-num-seqs sequences' windows (scheduler/window_blocks.py frees the blocks that
leave a window). The two pools have their own block ids; a step carries a block table for each."""
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
    num_window_blocks: int = 0      # > 0: the sliding-window layers' own pool (and its block tables)
    window: int = 0                 # with it: the window those layers attend over, in tokens

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size


def bytes_per_block(config: ModelConfig, block_size: int, codec: str = DEFAULT_CODEC, n_layers: int | None = None
                    ) -> int:
    """K and V of one block, every layer (or `n_layers` of them), in the codec's own bytes (q8_0: 34 a
    row of 32 values)."""
    layers = config.n_layers if n_layers is None else n_layers
    return 2 * layers * block_size * config.n_kv_heads * kv_codecs.row_bytes(codec, config.head_dim)


def windowed_layers(config: ModelConfig) -> list[int]:
    """The sliding-window layers of a model that also has full-attention ones (they get a pool of their
    own); empty otherwise (a model whose every layer is windowed keeps one pool)."""
    windowed = [il for il in range(config.n_layers) if config.layer_window(il) > 0]
    return windowed if config.causal and 0 < len(windowed) < config.n_layers else []


def window_blocks_per_sequence(window: int, block_size: int, tokens_per_step: int) -> int:
    """Blocks a sequence holds in the windowed pool at most, computing `tokens_per_step` positions
    from p: those that hold positions p - window + 1 .. p + tokens_per_step - 1."""
    return -(-(window - 1 + tokens_per_step) // block_size) + 1


# a decode row, its drafted tokens (--num-speculative-tokens at most 16) and a multi-step call's
DECODE_TOKENS_PER_STEP = 64


def plan_window_pool(config: ModelConfig, memory_bytes: int, block_size: int, codec: str,
                     max_num_seqs: int | None, max_num_batched_tokens: int) -> int:
    """Blocks of the windowed layers' own pool, 0 for none: what `max_num_seqs` decoding sequences and
    one prefill chunk of `max_num_batched_tokens` hold, when that is fewer blocks than one pool for
    every layer would have (then the full layers get the rest of the memory)."""
    windowed = windowed_layers(config)
    if not windowed or max_num_seqs is None:
        return 0
    window = max(config.layer_window(il) for il in windowed)
    decode = window_blocks_per_sequence(window, block_size, DECODE_TOKENS_PER_STEP)
    chunk = window_blocks_per_sequence(window, block_size, max_num_batched_tokens)
    need = max(1, max_num_seqs - 1) * decode + chunk
    return need if need < memory_bytes // bytes_per_block(config, block_size, codec) else 0


def plan_capacity(config: ModelConfig, memory_bytes: int, block_size: int = 16,
                  max_context: int | None = None, codec: str = DEFAULT_CODEC, max_num_seqs: int | None = None,
                  max_num_batched_tokens: int = 256) -> KVCapacity:
    """Blocks for `memory_bytes`; with `max_num_seqs` (None: one pool, every layer keeping every
    position, llama.cpp's --swa-full) a model with windowed layers gets their pool (plan_window_pool)."""
    num_window = plan_window_pool(config, memory_bytes, block_size, codec, max_num_seqs, max_num_batched_tokens)
    windowed = windowed_layers(config) if num_window else []
    per_block = bytes_per_block(config, block_size, codec, config.n_layers - len(windowed))
    window_bytes = num_window * bytes_per_block(config, block_size, codec, len(windowed))
    num_blocks = (memory_bytes - window_bytes) // per_block
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
    window = max((config.layer_window(il) for il in windowed), default=0)
    cap = KVCapacity(int(num_blocks), block_size, int(context), int(num_window), window)
    log.info("KV cache: %d blocks x %d tokens (%.1f MiB, %s), max context %d",
             cap.num_blocks, block_size, cap.num_blocks * per_block / 2**20, codec, cap.max_context)
    if num_window:
        log.info("KV cache of the %d sliding-window layers: %d blocks of their own (%.1f MiB), each sequence "
                 "keeping the last %d positions", len(windowed), num_window, window_bytes / 2**20, window)
    return cap


class KVPool:
    def __init__(self, config: ModelConfig, capacity: KVCapacity, ops: Backend, codec: str = DEFAULT_CODEC):
        self.capacity = capacity
        self.ops = ops
        self.codec = codec
        t0 = time.perf_counter()
        self.windowed = set(windowed_layers(config)) if capacity.num_window_blocks else set()
        self.caches = [ops.alloc_kv(capacity.num_window_blocks if il in self.windowed else capacity.num_blocks,
                                    capacity.block_size, config.n_kv_heads, config.head_dim, codec)
                       for il in range(config.n_layers)]
        log.info("KV cache allocated (%d layers) in %.2f s", config.n_layers, time.perf_counter() - t0)

    def copy_blocks(self, pairs: list[tuple[int, int]], window_pairs: list[tuple[int, int]] = ()) -> None:
        """Copy KV blocks src -> dst in every layer, `window_pairs` in the windowed layers' pool (all
        sources are read before any is written)."""
        for windowed, group in ((False, pairs), (True, window_pairs)):
            if not group:
                continue
            src = np.array([p[0] for p in group], np.int64)
            dst = np.array([p[1] for p in group], np.int64)
            for il, (k_cache, v_cache) in enumerate(self.caches):
                if (il in self.windowed) == windowed:
                    self.ops.copy_blocks(k_cache, v_cache, src, dst)
