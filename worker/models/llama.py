"""llama architecture (SmolLM2, Llama 2/3, ...), after llama.cpp's src/models/llama.cpp:
pre-norm blocks of RMSNorm -> GQA attention with normal RoPE -> RMSNorm -> SwiGLU FFN."""
from __future__ import annotations

import math
from dataclasses import dataclass

from kernels import Array, Backend
from shared.model_config import ModelConfig
from worker.models.base import ForwardInput, Model
from worker.weights import WeightLoader


@dataclass
class LlamaLayer:
    attn_norm: Array
    qkv: Array
    attn_output: Array
    ffn_norm: Array
    gate_up: Array
    down: Array


class LlamaModel(Model):
    def __init__(self, config: ModelConfig, weights: WeightLoader, ops: Backend):
        super().__init__(config, ops)
        c = config
        self.embed = weights.embedding("token_embd.weight", (c.vocab_size, c.d_model))
        tied = not weights.has("output.weight")
        self.output = weights.linear(("token_embd.weight" if tied else "output.weight", (c.vocab_size, c.d_model)))
        self.output_norm = weights.vector("output_norm.weight", c.d_model)
        shapes = self._attn_shapes()
        self.layers = []
        for i in range(c.n_layers):
            p = f"blk.{i}."
            self.layers.append(LlamaLayer(
                attn_norm=weights.vector(p + "attn_norm.weight", c.d_model),
                qkv=weights.linear(*((p + n + ".weight", shapes[n]) for n in ("attn_q", "attn_k", "attn_v"))),
                attn_output=weights.linear((p + "attn_output.weight", shapes["attn_output"])),
                ffn_norm=weights.vector(p + "ffn_norm.weight", c.d_model),
                gate_up=weights.linear((p + "ffn_gate.weight", (c.d_ff, c.d_model)),
                                       (p + "ffn_up.weight", (c.d_ff, c.d_model))),
                down=weights.linear((p + "ffn_down.weight", (c.d_model, c.d_ff))),
            ))

    def forward(self, inp: ForwardInput) -> Array:
        c, ops = self.config, self.ops
        scale = 1.0 / math.sqrt(c.head_dim)
        x = ops.embedding(self.embed, inp.token_ids)
        for il, layer in enumerate(self.layers):
            h = ops.rms_norm(x, layer.attn_norm, c.rms_eps)
            qk, v = self._split_qk_v(ops.matmul(h, layer.qkv))
            qk = ops.rope(qk, inp.positions, c.rope_base, c.rope_dims, c.rope_neox)
            q, k = qk[:, :c.n_heads], qk[:, c.n_heads:]
            k_cache, v_cache = self.kv_caches[il]
            meta = inp.attention.for_layer(c.layer_window(il))   # its own pool where windowed
            ops.store_kv(k_cache, v_cache, k, v, meta.slot_mapping)
            attn = ops.paged_attention(q, k_cache, v_cache, meta, scale, c.layer_window(il))
            attn = attn.reshape(attn.shape[0], -1)
            if il == c.n_layers - 1:  # the last layer's FFN only runs for rows that need logits
                attn, x = attn[inp.output_rows], x[inp.output_rows]
            x = x + ops.matmul(attn, layer.attn_output)
            h = ops.rms_norm(x, layer.ffn_norm, c.rms_eps)
            gate_up = ops.matmul(h, layer.gate_up)
            x = x + ops.matmul(ops.swiglu(gate_up[:, :c.d_ff], gate_up[:, c.d_ff:]), layer.down)
        return ops.rms_norm(x, self.output_norm, c.rms_eps)
