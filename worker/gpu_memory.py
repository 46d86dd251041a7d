"""How big a CUDA worker's KV pool is: the device's free memory × --gpu-memory-utilization (0.9 by
default, as vLLM's), less the weights' bytes and a fixed reserve. Pure functions of a device
description (worker/devices.py), so that they are tested without a GPU.

The weights are counted as the GGUF stores them (the CUDA backend multiplies the quantized blocks
in place). The reserve stands for what is not measured yet: the CUDA context, cuBLAS's workspace, a
step's activations and logits, captured graphs; a GPU run should measure it (vLLM profiles a
forward pass instead).
"""
from __future__ import annotations

from dataclasses import dataclass

from worker.devices import GPU

DEFAULT_GPU_MEMORY_UTILIZATION = 0.9
GPU_RESERVE_BYTES = 512 * 2**20


def gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


@dataclass(frozen=True)
class GpuBudget:
    """The KV pool's share of one device's memory, and how it was reached."""
    gpu: GPU
    utilization: float
    weights: int
    reserve: int = GPU_RESERVE_BYTES

    @property
    def usable(self) -> int:
        return int(self.gpu.free * self.utilization)

    @property
    def kv_bytes(self) -> int:
        """Bytes for the KV pool (0 where nothing is left)."""
        return max(0, self.usable - self.weights - self.reserve)

    def describe(self) -> str:
        return (f"GPU {self.gpu.index} ({self.gpu.name}) has {gib(self.gpu.free)} free; × --gpu-memory-utilization "
                f"{self.utilization:g} = {gib(self.usable)}, less the weights' {gib(self.weights)} and "
                f"{gib(self.reserve)} reserved, leaves {gib(self.kv_bytes)} for the KV pool")


def weight_bytes(gguf) -> int:
    """Bytes of every tensor of a GGUF file as stored (quantized blocks included)."""
    return int(sum(max(t.nbytes, 0) for t in gguf.tensors.values()))


def tokens_held(budget: GpuBudget, per_block: int, block_size: int) -> int:
    return (budget.kv_bytes // per_block) * block_size


def check_fit(budget: GpuBudget, per_block: int, block_size: int, max_context: int | None,
              model: str, trained_context: int) -> str | None:
    """None when the pool holds a block and, if given, `max_context`; else the reason, with its numbers
    (the rule of the CPU's --kv-memory check in worker/config.py). `per_block`: bytes of one KV block."""
    fits = tokens_held(budget, per_block, block_size)
    if fits < block_size:
        return (f"{budget.describe()}, which holds no KV block of {model} ({per_block} bytes at block size "
                f"{block_size}); raise --gpu-memory-utilization or free the device")
    if max_context is None:
        return None
    if max_context > trained_context:
        return (f"exceeds the trained context of {model}, {trained_context} tokens; "
                f"accepted: 1..{trained_context}")
    if -(-max_context // block_size) * block_size > fits:
        return (f"{budget.describe()}, which holds {fits} tokens of {model}'s KV at block size {block_size}; "
                "lower the context or raise --gpu-memory-utilization")
    return None
