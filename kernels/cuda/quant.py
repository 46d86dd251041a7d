"""Matrix products and embedding rows straight from a GGUF's quantized blocks on the device.

A prepared matrix keeps each GGUF tensor it was stacked from (fused Q|K|V, gate|up) as its raw
blocks in device memory, in the file's [out, in] row-major layout. Passes of few rows (decode)
run kernels/cuda/matmul.cu's gemv_blocks over the blocks (weight bytes are what decode reads);
larger passes dequantize each part to float16 and multiply on cuBLAS (gemmEx: f16 inputs, f32
accumulation and output), as llama.cpp's CUDA backend does for prompts.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from kernels.cuda.modules import Modules, grid_for

# GGML types whose blocks the kernels decode (quant_blocks.cuh); any other type is uploaded as
# float32 rows of the host's decoding.
F32, F16, BF16 = 0, 1, 30
DEVICE_TYPES = frozenset({F32, F16, 2, 3, 6, 7, 8, 12, 13, 14, BF16})
BLOCK = {F32: (1, 4), F16: (1, 2), BF16: (1, 2), 2: (32, 18), 3: (32, 20), 6: (32, 22), 7: (32, 24),
         8: (32, 34), 12: (256, 144), 13: (256, 176), 14: (256, 210)}

# cuBLAS enums (cublas_api.h, library_types.h)
_OP_N, _OP_T = 0, 1
_R_16F, _R_32F = 2, 0
_COMPUTE_32F = 68
_GEMM_DEFAULT = -1


@dataclass(frozen=True)
class Part:
    data: Any            # cupy uint8: the tensor's blocks
    ggml_type: int
    n_out: int
    n_in: int


@dataclass(frozen=True)
class CudaLinear:
    parts: tuple[Part, ...]
    n_out: int
    n_in: int


@dataclass(frozen=True)
class CudaEmbedding:
    data: Any
    ggml_type: int
    shape: tuple[int, int]


class QuantOps:
    def __init__(self, cp: Any, modules: Modules, variant: dict) -> None:
        self.cp, self.modules, self.variant = cp, modules, variant
        self._uploaded: dict[tuple[int, int], Any] = {}     # host buffer -> device copy (tied embeddings)
        self._scratch: Any = None                              # float16 weights of the prefill product
        try:
            from cupy_backends.cuda.libs import cublas
        except ImportError:                                    # older CuPy
            from cupy.cuda import cublas
        self.cublas = cublas
        self._one = np.ones(1, np.float32)
        self._zero = np.zeros(1, np.float32)

    def upload(self, raw: np.ndarray) -> Any:
        """Device copy of a GGUF tensor's bytes, shared by every user of the same host bytes (Gemma's
        output matrix is its embedding table)."""
        raw = np.ascontiguousarray(np.asarray(raw)).reshape(-1).view(np.uint8)
        key = (raw.__array_interface__["data"][0], raw.nbytes)
        dev = self._uploaded.get(key)
        if dev is None:
            dev = self._uploaded[key] = self.cp.asarray(raw)
        return dev

    def prepare_weight(self, w: np.ndarray, encoded: list[tuple[np.ndarray, int, tuple[int, int]]] | None) -> CudaLinear:
        n_out, n_in = w.shape
        parts, row = [], 0
        for raw, ggml_type, shape in encoded or [(None, F32, (n_out, n_in))]:
            rows = int(shape[0])
            if raw is None or int(ggml_type) not in DEVICE_TYPES:    # the host's float32 decoding
                data = self.cp.asarray(np.ascontiguousarray(w[row:row + rows], np.float32).view(np.uint8).reshape(-1))
                parts.append(Part(data, F32, rows, n_in))
            else:
                parts.append(Part(self.upload(raw), int(ggml_type), rows, n_in))
            row += rows
        if row != n_out:
            raise ValueError(f"encoded parts hold {row} rows, the matrix {n_out}")
        return CudaLinear(tuple(parts), n_out, n_in)

    def matmul(self, x: Any, lin: CudaLinear) -> Any:
        cp = self.cp
        x = cp.ascontiguousarray(x, dtype=cp.float32)
        n = x.shape[0]
        out = cp.empty((n, lin.n_out), cp.float32)
        if n == 0:
            return out
        if n < self.variant["prefill_min_rows"]:
            self._gemv(x, lin, out)
        else:
            self._gemm(x, lin, out)
        return out

    def _gemv(self, x: Any, lin: CudaLinear, out: Any) -> None:
        fn = self.modules.function("matmul", "gemv_blocks")
        warps, max_rows = self.variant["gemv_warps"], self.variant["gemv_max_rows"]
        for r0 in range(0, x.shape[0], max_rows):
            rows = min(max_rows, x.shape[0] - r0)
            col = 0
            for p in lin.parts:
                fn((-(-p.n_out // warps),), (warps * 32,),
                   (p.data, np.int32(p.ggml_type), np.int32(p.n_out), np.int32(p.n_in), x[r0:],
                    np.int32(lin.n_in), np.int32(rows), out[r0:, col:], np.int32(lin.n_out)))
                col += p.n_out

    def _gemm(self, x: Any, lin: CudaLinear, out: Any) -> None:
        cp = self.cp
        x16 = x.astype(cp.float16)                    # round to nearest even, as cvt.rn.f16.f32
        fn = self.modules.function("matmul", "dequant_f16")
        handle = cp.cuda.device.get_cublas_handle()
        n, col = x.shape[0], 0
        for p in lin.parts:
            size = p.n_out * p.n_in
            if self._scratch is None or self._scratch.size < size:
                self._scratch = cp.empty(size, cp.float16)
            w16 = self._scratch
            fn((grid_for(size, 256),), (256,), (p.data, np.int32(p.ggml_type), np.int64(size), w16))
            # row-major out[:, col:col+n_out] = x16 @ w16.T  <=>  column-major C (n_out x n) = W^T' ...
            # cuBLAS sees the row-major [n_out, n_in] weights as a column-major n_in x n_out matrix
            # (transposed: op T) and x16 as n_in x n (op N); C's leading dimension is out's row length
            self.cublas.gemmEx(handle, _OP_T, _OP_N, p.n_out, n, p.n_in,
                               self._one.ctypes.data, w16.data.ptr, _R_16F, p.n_in,
                               x16.data.ptr, _R_16F, p.n_in,
                               self._zero.ctypes.data, out.data.ptr + col * 4, _R_32F, lin.n_out,
                               _COMPUTE_32F, _GEMM_DEFAULT)
            col += p.n_out

    def prepare_embedding(self, raw: np.ndarray, ggml_type: int, shape: tuple[int, int]) -> CudaEmbedding:
        shape = (int(shape[0]), int(shape[1]))
        if int(ggml_type) not in DEVICE_TYPES:
            from shared.dequant import dequantize
            return CudaEmbedding(self.cp.asarray(dequantize(raw, ggml_type, shape).view(np.uint8).reshape(-1)), F32, shape)
        return CudaEmbedding(self.upload(raw), int(ggml_type), shape)

    def embedding(self, table: CudaEmbedding, ids: np.ndarray) -> Any:
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        n_rows, n_cols = table.shape
        if ids.size and (ids.min() < 0 or ids.max() >= n_rows):
            raise IndexError(f"token id out of range [0, {n_rows}): min {ids.min()}, max {ids.max()}")
        out = self.cp.empty((ids.size, n_cols), self.cp.float32)
        if ids.size:
            self.modules.function("embedding", "embed_rows")(
                (ids.size,), (128,), (table.data, np.int32(table.ggml_type), np.int32(n_cols), np.int32(n_rows),
                                      self.cp.asarray(ids), out))
        return out
