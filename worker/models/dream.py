"""dream architecture (Dream), after llama.cpp's src/models/dream.cpp: qwen2's blocks (biases on
Q, K and V, NEOX RoPE) with bidirectional attention, run as text diffusion like LLaDA
(worker/models/llada.py) except that its logits are shifted: position i's prediction is row
i - 1's (diffusion.shift_logits, true by default for Dream), row 0's for position 0."""
from __future__ import annotations

import numpy as np

from kernels import Backend
from shared.model_config import ModelConfig
from worker.models.llada import LladaModel
from worker.weights import WeightLoader


class DreamModel(LladaModel):
    def __init__(self, config: ModelConfig, weights: WeightLoader, ops: Backend):
        super().__init__(config, weights, ops)
        c = config
        # one bias per layer over the fused Q|K|V output, in the fused matrix's order
        self.qkv_biases = [
            ops.asarray(np.concatenate([
                weights.float32(f"blk.{i}.{name}.bias", (size,)) for name, size in (
                    ("attn_q", c.n_heads * c.head_dim), ("attn_k", c.n_kv_heads * c.head_dim),
                    ("attn_v", c.n_kv_heads * c.head_dim))]))
            for i in range(c.n_layers)]
        for layer, bias in zip(self.layers, self.qkv_biases):
            layer.qkv_bias = bias
