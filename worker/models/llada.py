"""llada architecture (LLaDA), after llama.cpp's src/models/llada.cpp: llama's blocks (RMSNorm ->
attention with normal RoPE -> RMSNorm -> SwiGLU FFN) with bidirectional attention, run as text
diffusion: one non-causal pass over each [prompt | canvas], whose row i predicts position i
(diffusion.shift_logits = false).

A pass packs several canvases (the scheduler's diffusion batch), and a canvas must get exactly the
logits it gets alone. Where the backend has row-invariant products (`rowwise_weight`: on the CPU,
float32 tiles whose every output is one FMA chain, or the 8-bit products), the model keeps its
matrices so and each product takes the whole pack in one call; elsewhere each product runs canvas
by canvas (OpenBLAS's AVX2 sgemm is not row-invariant: a row's result moves by an ulp with the
call's row count). Attention runs canvas by canvas either way; norms, RoPE and SwiGLU are row-wise
and run over the whole pack. The last layer's attention output and FFN run only for the rows
whose logits are read (a step reads the masked positions of each canvas's current block).
"""
from __future__ import annotations

import math

import numpy as np

from kernels import Array, Backend
from shared.model_config import ModelConfig
from worker.models.base import ForwardInput
from worker.models.llama import LlamaModel
from worker.weights import WeightLoader

_MATRICES = ("qkv", "attn_output", "gate_up", "down")


class LladaModel(LlamaModel):
    def __init__(self, config: ModelConfig, weights: WeightLoader, ops: Backend):
        super().__init__(config, weights, ops)
        # every matrix row-invariant, or none (then products run canvas by canvas)
        rowwise = getattr(ops, "rowwise_weight", None)
        owners = [(layer, name) for layer in self.layers for name in _MATRICES] + [(self, "output")]
        converted = [rowwise(getattr(o, n)) for o, n in owners] if rowwise is not None else [None]
        self.rowwise = all(w is not None for w in converted)
        if self.rowwise:
            for (o, n), w in zip(owners, converted):
                setattr(o, n, w)

    def bind_kv(self, kv_caches) -> None:
        """A canvas is recomputed whole every step: its K/V never enter the pool."""

    def forward(self, inp: ForwardInput) -> Array:
        """`inp.attention.query_lens`: the packed canvases' lengths; positions restart at 0 in each."""
        c, ops = self.config, self.ops
        lens = np.asarray(inp.attention.query_lens, np.int64)
        scale = 1.0 / math.sqrt(c.head_dim)
        x = ops.embedding(self.embed, inp.token_ids)
        last = len(self.layers) - 1
        for il, layer in enumerate(self.layers):
            h = ops.rms_norm(x, layer.attn_norm, c.rms_eps)
            qkv = self.per_canvas(h, layer.qkv, lens)
            bias = getattr(layer, "qkv_bias", None)      # Dream's Q|K|V biases
            if bias is not None:
                qkv = qkv + bias
            qk, v = self._split_qk_v(qkv)
            qk = ops.rope(qk, inp.positions, c.rope_base, c.rope_dims, c.rope_neox)
            if il == last and self.rowwise:      # only the rows whose logits are read go on
                attn = ops.dense_attention(qk[:, :c.n_heads], qk[:, c.n_heads:], v, lens, scale, inp.output_rows)
                x = x[inp.output_rows]
            else:
                attn = ops.dense_attention(qk[:, :c.n_heads], qk[:, c.n_heads:], v, lens, scale)
            attn = attn.reshape(attn.shape[0], -1)
            x = x + self.per_canvas(attn, layer.attn_output, lens)
            h = ops.rms_norm(x, layer.ffn_norm, c.rms_eps)
            gate_up = self.per_canvas(h, layer.gate_up, lens)
            x = x + self.per_canvas(ops.swiglu(gate_up[:, :c.d_ff], gate_up[:, c.d_ff:]), layer.down, lens)
        if not self.rowwise:
            x = x[inp.output_rows]
        return ops.rms_norm(x, self.output_norm, c.rms_eps)

    def per_canvas(self, x: Array, w: object, lens: np.ndarray) -> Array:
        """x @ w, each row as it would be alone: in one product where the weights are row-invariant,
        else one canvas's rows at a time."""
        if self.rowwise or len(lens) == 1:
            return self.ops.matmul(x, w)
        parts, start = [], 0
        for n in lens.tolist():
            parts.append(self.ops.matmul(x[start:start + n], w))
            start += n
        return np.concatenate(parts)
