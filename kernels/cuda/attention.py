"""The paged KV pool on the device and attention over it (kernels/cuda/kv_store.cu,
attention.cu), with the CPU backend's layout: each layer's K and V are
[kv_heads, blocks, block_size, units], units float16 values (f16) or the bytes of ggml's q8_0/q4_0
blocks (uint8, 34 or 18 bytes per 32 values: CuPy has no structured dtypes, so the codec is
read from the dtype and the row's byte count). Block tables, slot mapping and the per-row
sequence/visible-key ends come from AttentionMetadata, uploaded once a pass."""
from __future__ import annotations

from typing import Any

import numpy as np

from kernels import AttentionMetadata
from kernels.cuda.modules import Modules, grid_for

F16, Q8_0, Q4_0 = 0, 1, 2
NAMES = ("f16", "q8_0", "q4_0")
BLOCK_BYTES = {Q8_0: 34, Q4_0: 18}


def codec_of(cache: Any, head_dim: int) -> int:
    if cache.dtype.itemsize == 2:
        return F16
    units = cache.shape[-1]
    for codec, size in BLOCK_BYTES.items():
        if units == head_dim // 32 * size:
            return codec
    raise TypeError(f"a KV cache of dtype {cache.dtype} and rows of {units} for head_dim {head_dim}")


class AttentionOps:
    def __init__(self, cp: Any, modules: Modules, variant: dict) -> None:
        self.cp, self.modules, self.warps = cp, modules, variant["attn_warps"]

    def alloc_kv(self, num_blocks: int, block_size: int, n_kv_heads: int, head_dim: int, codec: str) -> tuple[Any, Any]:
        if codec not in NAMES:
            raise ValueError(f"unknown KV cache dtype {codec!r} (accepted: {', '.join(NAMES)})")
        if head_dim % 32 or head_dim > 256:
            raise ValueError(f"the CUDA attention takes head_dim a multiple of 32 up to 256, not {head_dim}")
        cp = self.cp
        if codec == "f16":
            shape, dtype = (n_kv_heads, num_blocks, block_size, head_dim), cp.float16
        else:
            shape, dtype = (n_kv_heads, num_blocks, block_size, head_dim // 32 * BLOCK_BYTES[NAMES.index(codec)]), cp.uint8
        return cp.zeros(shape, dtype), cp.zeros(shape, dtype)

    def store_kv(self, k_cache: Any, v_cache: Any, k: Any, v: Any, slot_mapping: np.ndarray) -> None:
        slots = self.cp.asarray(np.asarray(slot_mapping, dtype=np.int64))
        for cache, rows in ((k_cache, k), (v_cache, v)):
            rows = self._heads(rows)
            n, kv_heads, dim = rows.shape
            total = n * kv_heads * (dim // 32)
            if total:
                self.modules.function("kv_store", "store_kv")(
                    (grid_for(total, 128),), (128,),
                    (rows, np.int64(rows.strides[0] // 4), np.int64(rows.strides[1] // 4), slots, np.int32(n),
                     np.int32(kv_heads), np.int32(dim), np.int32(codec_of(cache, dim)), np.int32(cache.shape[2]),
                     np.int32(cache.shape[1]), cache))

    def copy_blocks(self, k_cache: Any, v_cache: Any, src: np.ndarray, dst: np.ndarray) -> None:
        src, dst = self.cp.asarray(np.asarray(src, np.int64)), self.cp.asarray(np.asarray(dst, np.int64))
        k_cache[:, dst] = k_cache[:, src]
        v_cache[:, dst] = v_cache[:, src]

    def _heads(self, a: Any) -> Any:
        """float32 [n, heads, d] with contiguous head rows (K: a view into the fused Q|K heads)."""
        cp = self.cp
        if a.dtype != cp.float32 or a.strides[2] != 4 or a.strides[1] % 4 or a.strides[0] % 4:
            a = cp.ascontiguousarray(a, dtype=cp.float32)
        return a

    def _rows(self, meta: AttentionMetadata) -> tuple[Any, Any, Any]:
        """(block tables int32, each row's sequence, each row's end of visible keys) on the device,
        kept on the metadata for every layer of the pass."""
        held = meta.__dict__.get("_cuda_rows")
        if held is None:
            qlens = np.asarray(meta.query_lens, np.int64)
            seq = np.repeat(np.arange(len(qlens)), qlens)
            ctx = np.asarray(meta.context_lens, np.int64)[seq]
            if meta.causal:      # the row j of a sequence's n new rows sees ctx - (n - 1 - j) keys
                starts = np.cumsum(qlens) - qlens
                ctx = ctx - (qlens[seq] - 1 - (np.arange(len(seq)) - starts[seq]))
            cp = self.cp
            held = (cp.asarray(np.ascontiguousarray(meta.block_tables, np.int32)), cp.asarray(seq.astype(np.int32)),
                    cp.asarray(ctx.astype(np.int32)))
            meta.__dict__["_cuda_rows"] = held
        return held

    def paged_attention(self, q: Any, k_cache: Any, v_cache: Any, meta: AttentionMetadata, scale: float,
                        window: int = 0) -> Any:
        cp = self.cp
        q = self._heads(q)
        n, heads, dim = q.shape
        kv_heads, n_blocks, block_size = k_cache.shape[:3]
        out = cp.empty((n, heads, dim), cp.float32)
        if not n:
            return out
        tables, row_seq, row_end = self._rows(meta)
        self.modules.function("attention", "paged_attention")(
            (n, heads), (self.warps * 32,),
            (q, np.int64(q.strides[0] // 4), np.int64(q.strides[1] // 4), k_cache, v_cache,
             np.int32(codec_of(k_cache, dim)), tables, np.int32(tables.shape[1]), row_seq, row_end,
             np.int32(window if meta.causal else 0), np.float32(scale), np.int32(heads), np.int32(kv_heads),
             np.int32(dim), np.int32(block_size), np.int32(n_blocks), out))
        return out

    def dense_attention(self, q: Any, k: Any, v: Any, seq_lens: np.ndarray, scale: float) -> Any:
        """Non-causal attention of each packed sequence over its own rows (diffusion canvases), in
        float32 on cuBLAS, sequence by sequence as the CPU backend."""
        cp = self.cp
        n_heads, dim = q.shape[1], q.shape[2]
        n_kv = k.shape[1]
        group = n_heads // n_kv
        out = cp.empty(q.shape, cp.float32)
        start = 0
        for n in (int(x) for x in seq_lens):
            qs = q[start:start + n].reshape(n, n_kv, group, dim).transpose(1, 2, 0, 3).reshape(n_kv, group * n, dim)
            scores = cp.matmul(qs, k[start:start + n].transpose(1, 2, 0)) * np.float32(scale)
            scores -= scores.max(axis=-1, keepdims=True)
            cp.exp(scores, out=scores)
            scores /= scores.sum(axis=-1, keepdims=True)
            acc = cp.matmul(scores, v[start:start + n].transpose(1, 0, 2))
            out[start:start + n] = acc.reshape(n_kv, group, n, dim).transpose(2, 0, 1, 3).reshape(n, n_heads, dim)
            start += n
        return out
