"""What every architecture file provides, and the packed-batch input it runs on."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator

import numpy as np

from kernels import Array, AttentionMetadata, Backend
from shared.model_config import ModelConfig


@dataclass
class ForwardInput:
    token_ids: np.ndarray        # int64 [n_tokens], sequences packed one after another
    positions: np.ndarray        # int64 [n_tokens]
    attention: AttentionMetadata
    output_rows: np.ndarray      # int64: rows whose final hidden state is wanted (logits)


class Model:
    """Base of the architectures: holds config and backend; subclasses load weights and define forward."""

    def __init__(self, config: ModelConfig, ops: Backend):
        self.config, self.ops = config, ops
        self.kv_caches: list[tuple[Array, Array]] = []

    def bind_kv(self, kv_caches: list[tuple[Array, Array]]) -> None:
        self.kv_caches = kv_caches

    @contextlib.contextmanager
    def using_ops(self, ops) -> Iterator[None]:
        """Run `forward` against another backend for a while (a backend capturing the graph)."""
        held, self.ops = self.ops, ops
        try:
            yield
        finally:
            self.ops = held

    def forward(self, inp: ForwardInput) -> Array:
        """Final normed hidden states of `inp.output_rows`, [len(output_rows), d_model]."""
        raise NotImplementedError

    def logits(self, hidden: Array) -> Array:
        """[n, d_model] -> [n, vocab] float32."""
        return self.ops.matmul(hidden, self.output)

    # shapes in numpy order: [out_features, in_features]
    def _attn_shapes(self) -> dict[str, tuple[int, int]]:
        c = self.config
        return {
            "attn_q": (c.n_heads * c.head_dim, c.d_model),
            "attn_k": (c.n_kv_heads * c.head_dim, c.d_model),
            "attn_v": (c.n_kv_heads * c.head_dim, c.d_model),
            "attn_output": (c.d_model, c.n_heads * c.head_dim),
        }

    def _split_qk_v(self, qkv: Array) -> tuple[Array, Array]:
        """Fused projection output -> (Q and K heads together [n, heads + kv_heads, d], V [n, kv_heads, d]).

        Q and K stay together so per-head operations (RoPE, QK-norm) run once for both."""
        c = self.config
        n = qkv.shape[0]
        qk_end = (c.n_heads + c.n_kv_heads) * c.head_dim
        return (qkv[:, :qk_end].reshape(n, c.n_heads + c.n_kv_heads, c.head_dim),
                qkv[:, qk_end:].reshape(n, c.n_kv_heads, c.head_dim))
