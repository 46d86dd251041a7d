"""gemma3 architecture, after llama.cpp's src/models/gemma3.cpp: embeddings scaled by
sqrt(d_model); QK-norm; NeoX RoPE with base 10000 on sliding-window layers; post-attention
and post-FFN norms; tanh-GELU gated FFN; output tied to the embedding."""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from kernels import Array, Backend
from shared.model_config import ModelConfig
from worker.models.base import ForwardInput, Model
from worker.weights import WeightLoader


@dataclass
class Gemma3Layer:
    attn_norm: Array
    qkv: Array
    qk_norm: Array          # [n_heads + n_kv_heads, head_dim]: attn_q_norm per Q head, attn_k_norm per K head
    attn_output: Array
    attn_post_norm: Array
    ffn_norm: Array
    gate_up: Array
    down: Array
    ffn_post_norm: Array


class Gemma3Model(Model):
    def __init__(self, config: ModelConfig, weights: WeightLoader, ops: Backend):
        super().__init__(config, ops)
        c = config
        self.embed = weights.embedding("token_embd.weight", (c.vocab_size, c.d_model))
        tied = not weights.has("output.weight")
        self.output = weights.linear(("token_embd.weight" if tied else "output.weight", (c.vocab_size, c.d_model)))
        self.output_norm = weights.vector("output_norm.weight", c.d_model)
        # llama.cpp: f_attention_scale = 1/sqrt(head_dim) for the small Gemma 3 models (query_pre_attn_scalar)
        self.query_scale = 1.0 / math.sqrt(c.head_dim)
        shapes = self._attn_shapes()
        self.layers = []
        for i in range(c.n_layers):
            p = f"blk.{i}."
            self.layers.append(Gemma3Layer(
                attn_norm=weights.vector(p + "attn_norm.weight", c.d_model),
                qkv=weights.linear(*((p + n + ".weight", shapes[n]) for n in ("attn_q", "attn_k", "attn_v"))),
                qk_norm=self._qk_norm(weights, p),
                attn_output=weights.linear((p + "attn_output.weight", shapes["attn_output"])),
                attn_post_norm=weights.vector(p + "post_attention_norm.weight", c.d_model),
                ffn_norm=weights.vector(p + "ffn_norm.weight", c.d_model),
                gate_up=weights.linear((p + "ffn_gate.weight", (c.d_ff, c.d_model)),
                                       (p + "ffn_up.weight", (c.d_ff, c.d_model))),
                down=weights.linear((p + "ffn_down.weight", (c.d_model, c.d_ff))),
                ffn_post_norm=weights.vector(p + "post_ffw_norm.weight", c.d_model),
            ))

    def _qk_norm(self, weights: WeightLoader, prefix: str) -> Array:
        c = self.config
        q = weights.float32(prefix + "attn_q_norm.weight", (c.head_dim,))
        k = weights.float32(prefix + "attn_k_norm.weight", (c.head_dim,))
        return self.ops.asarray(np.concatenate([np.tile(q, (c.n_heads, 1)), np.tile(k, (c.n_kv_heads, 1))]))

    def forward(self, inp: ForwardInput) -> Array:
        c, ops = self.config, self.ops
        x = ops.embedding(self.embed, inp.token_ids) * np.float32(math.sqrt(c.d_model))
        for il, layer in enumerate(self.layers):
            h = ops.rms_norm(x, layer.attn_norm, c.rms_eps)
            qk, v = self._split_qk_v(ops.matmul(h, layer.qkv))
            qk = ops.rms_norm(qk, layer.qk_norm, c.rms_eps)     # QK-norm: per-head weights, Q's then K's
            qk = ops.rope(qk, inp.positions, c.layer_rope_base(il), c.rope_dims, c.rope_neox)
            q, k = qk[:, :c.n_heads], qk[:, c.n_heads:]
            k_cache, v_cache = self.kv_caches[il]
            meta = inp.attention.for_layer(c.layer_window(il))   # its own pool where windowed
            ops.store_kv(k_cache, v_cache, k, v, meta.slot_mapping)
            attn = ops.paged_attention(q, k_cache, v_cache, meta, self.query_scale, c.layer_window(il))
            attn = attn.reshape(attn.shape[0], -1)
            if il == c.n_layers - 1:
                attn, x = attn[inp.output_rows], x[inp.output_rows]
            x = x + ops.rms_norm(ops.matmul(attn, layer.attn_output), layer.attn_post_norm, c.rms_eps)
            h = ops.rms_norm(x, layer.ffn_norm, c.rms_eps)
            gate_up = ops.matmul(h, layer.gate_up)
            ffn = ops.matmul(ops.gelu_tanh_gate(gate_up[:, :c.d_ff], gate_up[:, c.d_ff:]), layer.down)
            x = x + ops.rms_norm(ffn, layer.ffn_post_norm, c.rms_eps)
        return ops.rms_norm(x, self.output_norm, c.rms_eps)
