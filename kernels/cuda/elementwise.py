"""Launchers of kernels/cuda/norm_rope.cu and activations.cu: RMSNorm, RoPE (and Gemma 3's
QK-norm fused with it), SwiGLU and the GELU-tanh gate."""
from __future__ import annotations

from typing import Any

import numpy as np

from kernels.cuda.modules import Modules, grid_for


class ElementwiseOps:
    def __init__(self, cp: Any, modules: Modules, variant: dict) -> None:
        self.cp, self.modules, self.threads = cp, modules, variant["norm_threads"]
        self._tables: dict[tuple[float, int], tuple[Any, Any, int]] = {}
        self._positions: tuple[np.ndarray, Any] | None = None

    def rms_norm(self, x: Any, weight: Any, eps: float) -> Any:
        cp = self.cp
        x = cp.ascontiguousarray(x, dtype=cp.float32)
        dim = x.shape[-1]
        w = cp.ascontiguousarray(weight, dtype=cp.float32)
        y = cp.empty_like(x)
        rows = x.size // dim
        if rows:
            self.modules.function("norm_rope", "rms_norm")(
                (rows,), (self.threads,), (x, w, np.int32(dim), np.int32(w.size // dim), np.float32(eps), y))
        return y

    def rope_table(self, base: float, n_dims: int, max_pos: int) -> tuple[Any, Any]:
        """cos and sin [size, n_dims // 2] on the device, computed as the CPU backend's (float64
        angles, rounded to float32), so both backends rotate by the same numbers."""
        key = (float(base), n_dims)
        held = self._tables.get(key)
        if held is None or held[2] <= max_pos:
            size = max(4096, 1 << int(max_pos).bit_length())
            inv_freq = base ** (-np.arange(0, n_dims, 2, dtype=np.float64) / n_dims)
            angles = np.arange(size, dtype=np.float64)[:, None] * inv_freq[None, :]
            held = (self.cp.asarray(np.cos(angles).astype(np.float32)),
                    self.cp.asarray(np.sin(angles).astype(np.float32)), size)
            self._tables[key] = held
        return held[0], held[1]

    def _device_positions(self, positions: np.ndarray) -> Any:
        """positions uploaded once for every layer of a pass (the same host array)."""
        if self._positions is None or self._positions[0] is not positions:
            self._positions = (positions, self.cp.asarray(np.asarray(positions, dtype=np.int64)))
        return self._positions[1]

    def rope(self, x: Any, positions: np.ndarray, base: float, n_dims: int, neox: bool) -> Any:
        cp = self.cp
        x = cp.ascontiguousarray(x, dtype=cp.float32)
        n, heads, dim = x.shape
        cos_t, sin_t = self.rope_table(base, n_dims, int(np.max(positions, initial=0)))
        y = cp.empty_like(x)
        if n:
            self.modules.function("norm_rope", "rope")(
                (n * heads,), (min(128, max(32, n_dims // 2)),),
                (x, self._device_positions(positions), cos_t, sin_t, np.int32(heads), np.int32(dim),
                 np.int32(n_dims), np.int32(bool(neox)), y))
        return y

    def qk_norm_rope(self, x: Any, weight: Any, eps: float, positions: np.ndarray, base: float, n_dims: int,
                     neox: bool) -> Any:
        """rope(rms_norm(x, weight, eps), ...) in one kernel (Gemma 3's QK-norm; weight [heads, dim])."""
        cp = self.cp
        x = cp.ascontiguousarray(x, dtype=cp.float32)
        n, heads, dim = x.shape
        w = cp.ascontiguousarray(weight, dtype=cp.float32)
        cos_t, sin_t = self.rope_table(base, n_dims, int(np.max(positions, initial=0)))
        y = cp.empty_like(x)
        if n:
            self.modules.function("norm_rope", "qk_norm_rope")(
                (n * heads,), (self.threads,),
                (x, w, np.int32(w.size // dim), np.float32(eps), self._device_positions(positions), cos_t, sin_t,
                 np.int32(heads), np.int32(dim), np.int32(n_dims), np.int32(bool(neox)), y),
                shared_mem=4 * dim)
        return y

    def gate(self, kernel: str, gate: Any, up: Any) -> Any:
        """swiglu or gelu_tanh_gate of [n, d] gate and up (column slices of one product allowed)."""
        cp = self.cp
        gate, up = self._rows(gate), self._rows(up)
        n, d = gate.shape
        out = cp.empty((n, d), cp.float32)
        if n * d:
            self.modules.function("activations", kernel)(
                (grid_for(n * d, 256),), (256,),
                (gate, np.int32(gate.strides[0] // 4), up, np.int32(up.strides[0] // 4), np.int32(n), np.int32(d), out))
        return out

    def _rows(self, a: Any) -> Any:
        """float32 [n, d] whose rows are contiguous (a column slice keeps its row stride)."""
        cp = self.cp
        if a.dtype != cp.float32 or a.ndim != 2 or a.strides[1] != 4 or a.strides[0] % 4:
            a = cp.ascontiguousarray(a.reshape(a.shape[0], -1), dtype=cp.float32)
        return a
