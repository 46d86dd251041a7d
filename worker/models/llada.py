"""llada architecture (LLaDA), after llama.cpp's src/models/llada.cpp: llama's blocks (RMSNorm ->
attention with normal RoPE -> RMSNorm -> SwiGLU FFN) with bidirectional attention, run as text
diffusion: one non-causal pass over each [prompt | canvas], whose row i predicts position i
(diffusion.shift_logits = false).

A pass packs several canvases (the scheduler's diffusion batch). Every product runs canvas by
canvas and attention too: OpenBLAS's AVX2 sgemm kernels are not row-invariant (a row's result
moves by an ulp with the call's row count), and a canvas must get exactly the logits it gets alone.
Norms, RoPE and SwiGLU are row-wise already and run over the whole pack.
"""
from __future__ import annotations

import math

import numpy as np

from kernels import Array
from worker.models.base import ForwardInput
from worker.models.llama import LlamaModel


class LladaModel(LlamaModel):
    def bind_kv(self, kv_caches) -> None:
        """A canvas is recomputed whole every step: its K/V never enter the pool."""

    def forward(self, inp: ForwardInput) -> Array:
        """`inp.attention.query_lens`: the packed canvases' lengths; positions restart at 0 in each."""
        c, ops = self.config, self.ops
        lens = np.asarray(inp.attention.query_lens, np.int64)
        scale = 1.0 / math.sqrt(c.head_dim)
        x = ops.embedding(self.embed, inp.token_ids)
        for layer in self.layers:
            h = ops.rms_norm(x, layer.attn_norm, c.rms_eps)
            qkv = self.per_canvas(h, layer.qkv, lens)
            bias = getattr(layer, "qkv_bias", None)      # Dream's Q|K|V biases
            if bias is not None:
                qkv = qkv + bias
            qk, v = self._split_qk_v(qkv)
            qk = ops.rope(qk, inp.positions, c.rope_base, c.rope_dims, c.rope_neox)
            attn = ops.dense_attention(qk[:, :c.n_heads], qk[:, c.n_heads:], v, lens, scale)
            x = x + self.per_canvas(attn.reshape(attn.shape[0], -1), layer.attn_output, lens)
            h = ops.rms_norm(x, layer.ffn_norm, c.rms_eps)
            gate_up = self.per_canvas(h, layer.gate_up, lens)
            x = x + self.per_canvas(ops.swiglu(gate_up[:, :c.d_ff], gate_up[:, c.d_ff:]), layer.down, lens)
        return ops.rms_norm(x[inp.output_rows], self.output_norm, c.rms_eps)

    def per_canvas(self, x: Array, w: object, lens: np.ndarray) -> Array:
        """x @ w one canvas's rows at a time (row-invariant whatever is packed beside them)."""
        if len(lens) == 1:
            return self.ops.matmul(x, w)
        parts, start = [], 0
        for n in lens.tolist():
            parts.append(self.ops.matmul(x[start:start + n], w))
            start += n
        return np.concatenate(parts)
