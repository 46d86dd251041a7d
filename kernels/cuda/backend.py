"""CUDABackend: the kernels interface (kernels.Backend) on one NVIDIA GPU through CuPy.

Arrays are cupy.ndarray float32; weights stay in their GGUF encoding on the device
(kernels/cuda/quant.py), the KV pool is paged as the CPU backend's (kernels/cuda/attention.py),
and token choice runs on the device (kernels/cuda/sampling.py). CuPy is imported here, when a
backend is constructed, never by `import kernels.cuda`."""
from __future__ import annotations

from typing import Any

import numpy as np

from kernels import AttentionMetadata
from kernels.cuda import variants


def _import_cupy() -> Any:
    try:
        import cupy
    except ImportError as e:
        raise RuntimeError("the CUDA backend needs CuPy, which is not installed "
                           "(pip install cupy-cuda12x or cupy-cuda13x, matching the driver's CUDA): " + str(e)) from None
    return cupy


class CUDABackend:
    name = "cuda"

    def __init__(self, device: int = 0, variant: dict | None = None) -> None:
        cp = _import_cupy()
        try:
            count = cp.cuda.runtime.getDeviceCount()
        except Exception as e:      # CUDARuntimeError: no driver, or no device visible
            raise RuntimeError(f"the CUDA backend found no usable GPU (CUDA runtime: {e})") from None
        if not 0 <= device < count:
            raise RuntimeError(f"the CUDA backend was asked for GPU {device}, but CUDA sees {count} device(s)")
        self.cp = cp
        self.device_id = device
        self.device = cp.cuda.Device(device)
        self.device.use()
        cap = self.device.compute_capability           # e.g. "90"
        self.variant = variant if variant is not None else variants.for_capability(int(cap[:-1]), int(cap[-1]))
        from kernels.cuda.attention import AttentionOps
        from kernels.cuda.elementwise import ElementwiseOps
        from kernels.cuda.modules import Modules
        from kernels.cuda.quant import QuantOps
        from kernels.cuda.sampling import SamplingOps
        self.modules = Modules(cp, self.variant)
        self.quant = QuantOps(cp, self.modules, self.variant)
        self.elementwise = ElementwiseOps(cp, self.modules, self.variant)
        self.attention = AttentionOps(cp, self.modules, self.variant)
        self.sampling = SamplingOps(cp, self.modules)

    @property
    def products(self) -> str:
        return (f"CUDA GPU {self.device_id} ({self.variant['name']}): GGUF blocks (GEMV) for passes of "
                f"< {self.variant['prefill_min_rows']} rows, float16 cuBLAS above")

    def warm_up(self) -> None:
        self.modules.compile_all()

    def plan_weights(self, ggml_types: set[int]) -> None:
        """Every type decodes on the device or is uploaded as float32: no model-wide choice."""

    def begin_pass(self, num_tokens: int, decode: bool = False) -> None:
        """Products choose GEMV or cuBLAS by their own rows: nothing to decide per pass."""

    def run_forward(self, model: Any, inp: Any) -> Any:
        return model.forward(inp)

    def run_logits(self, model: Any, inp: Any) -> tuple[Any, np.ndarray]:
        """Logits and each row's argmax, taken on the device (-1: a NaN or infinite logit)."""
        logits = model.logits(model.forward(inp))
        return logits, self.sampling.argmax(logits)

    # --- arrays ---------------------------------------------------------------
    def asarray(self, x: np.ndarray) -> Any:
        return self.cp.asarray(np.ascontiguousarray(x, dtype=np.float32))

    def to_numpy(self, x: Any) -> np.ndarray:
        return self.cp.asnumpy(x) if isinstance(x, self.cp.ndarray) else np.asarray(x)

    # --- products and embeddings ----------------------------------------------------
    def prepare_weight(self, w: np.ndarray, encoded: list[tuple[np.ndarray, int, tuple[int, int]]] | None = None) -> Any:
        return self.quant.prepare_weight(w, encoded)

    def matmul(self, x: Any, w: Any) -> Any:
        return self.quant.matmul(x, w)

    def prepare_embedding(self, raw: np.ndarray, ggml_type: int, shape: tuple[int, int]) -> Any:
        return self.quant.prepare_embedding(raw, ggml_type, shape)

    def embedding(self, table: Any, ids: np.ndarray) -> Any:
        return self.quant.embedding(table, ids)

    # --- element-wise ---------------------------------------------------------------
    def rms_norm(self, x: Any, weight: Any, eps: float) -> Any:
        return self.elementwise.rms_norm(x, weight, eps)

    def rope(self, x: Any, positions: np.ndarray, base: float, n_dims: int, neox: bool) -> Any:
        return self.elementwise.rope(x, positions, base, n_dims, neox)

    def qk_norm_rope(self, x: Any, weight: Any, eps: float, positions: np.ndarray, base: float, n_dims: int,
                     neox: bool) -> Any:
        """rope(rms_norm(x, weight, eps), positions, ...) in one kernel (Gemma 3's QK-norm)."""
        return self.elementwise.qk_norm_rope(x, weight, eps, positions, base, n_dims, neox)

    def swiglu(self, gate: Any, up: Any) -> Any:
        return self.elementwise.gate("swiglu", gate, up)

    def gelu_tanh_gate(self, gate: Any, up: Any) -> Any:
        return self.elementwise.gate("gelu_tanh_gate", gate, up)

    def log_softmax(self, x: Any) -> Any:
        cp = self.cp
        shifted = x - x.max(axis=-1, keepdims=True)
        shifted -= cp.log(cp.exp(shifted).sum(axis=-1, keepdims=True))
        return shifted

    def top_k(self, x: Any, k: int) -> tuple[np.ndarray, np.ndarray]:
        cp = self.cp
        k = min(k, x.shape[-1])
        idx = cp.argsort(-x, axis=-1)[..., :k]
        return cp.asnumpy(idx), cp.asnumpy(cp.take_along_axis(x, idx, axis=-1))

    # --- token choice ----------------------------------------------------------------
    def argmax(self, logits: Any) -> np.ndarray:
        return self.sampling.argmax(logits)

    def sample(self, logits: Any, temperature: np.ndarray, top_k: np.ndarray, top_p: np.ndarray,
               seeds: np.ndarray, counters: np.ndarray) -> np.ndarray:
        """A token per row chosen on the device (see kernels/cuda/sampling.py); int64 numpy."""
        return self.sampling.sample(logits, temperature, top_k, top_p, seeds, counters)

    # --- KV cache and attention ------------------------------------------------------
    def alloc_kv(self, num_blocks: int, block_size: int, n_kv_heads: int, head_dim: int,
                 codec: str = "f16") -> tuple[Any, Any]:
        return self.attention.alloc_kv(num_blocks, block_size, n_kv_heads, head_dim, codec)

    def store_kv(self, k_cache: Any, v_cache: Any, k: Any, v: Any, slot_mapping: np.ndarray) -> None:
        self.attention.store_kv(k_cache, v_cache, k, v, slot_mapping)

    def copy_blocks(self, k_cache: Any, v_cache: Any, src: np.ndarray, dst: np.ndarray) -> None:
        self.attention.copy_blocks(k_cache, v_cache, src, dst)

    def paged_attention(self, q: Any, k_cache: Any, v_cache: Any, meta: AttentionMetadata, scale: float,
                        window: int = 0) -> Any:
        return self.attention.paged_attention(q, k_cache, v_cache, meta, scale, window)

    def dense_attention(self, q: Any, k: Any, v: Any, seq_lens: np.ndarray, scale: float) -> Any:
        return self.attention.dense_attention(q, k, v, seq_lens, scale)
