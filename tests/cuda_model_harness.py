"""A model on a given kernels backend with its own small paged KV pool, driven pass by pass:
what tests/test_cuda_kernels.py needs to run both bundled models on CUDABackend and CPUBackend
without the worker (whose backend selection is another change)."""
from __future__ import annotations

import numpy as np

from kernels import AttentionMetadata
from worker.models import ForwardInput


class PagedModel:
    def __init__(self, model: str, ops, codec: str = "f16", blocks: int = 32, block_size: int = 16, seed: int = 0):
        from shared.gguf_file import GGUFFile
        from shared.model_config import ModelConfig
        from shared.model_registry import resolve_model
        from worker.models import model_class
        from worker.weights import WeightLoader
        gguf = GGUFFile(resolve_model(model))
        cls = model_class(gguf.architecture, gguf.path)
        self.config = c = ModelConfig.from_gguf(gguf)
        self.ops, self.block_size = ops, block_size
        ops.plan_weights({t.ggml_type for t in gguf.tensors.values() if len(t.shape) == 2})
        ops.warm_up()
        self.model = cls(c, WeightLoader(gguf, ops), ops)
        self.model.bind_kv([ops.alloc_kv(blocks, block_size, c.n_kv_heads, c.head_dim, codec)
                            for _ in range(c.n_layers)])
        # blocks in a shuffled order: reading through the table, not by position, is what is tested
        self.table = np.random.default_rng(seed).permutation(blocks).astype(np.int64)

    def _slots(self, positions: np.ndarray) -> np.ndarray:
        return self.table[positions // self.block_size] * self.block_size + positions % self.block_size

    def prefill(self, tokens: list[int], all_rows: bool = False) -> np.ndarray:
        """Logits of the prompt's last row (every row with all_rows), one pass from position 0."""
        n = len(tokens)
        pos = np.arange(n, dtype=np.int64)
        meta = AttentionMetadata(np.array([n], np.int64), np.array([n], np.int64), self.table[None].astype(np.int32),
                                 self._slots(pos))
        rows = pos if all_rows else np.array([n - 1], np.int64)
        return self._logits(ForwardInput(np.asarray(tokens, np.int64), pos, meta, rows))

    def decode(self, token: int, position: int) -> np.ndarray:
        pos = np.array([position], np.int64)
        meta = AttentionMetadata.for_decode(np.array([position + 1], np.int64), self.table[None], self._slots(pos))
        return self._logits(ForwardInput(np.array([token], np.int64), pos, meta, np.zeros(1, np.int64)))

    def _logits(self, inp: ForwardInput) -> np.ndarray:
        self.ops.begin_pass(len(inp.token_ids), inp.attention.decode_pass)
        hidden = self.ops.run_forward(self.model, inp)
        self.ops.begin_pass(hidden.shape[0])
        return self.ops.to_numpy(self.model.logits(hidden))

    def greedy(self, prompt: list[int], steps: int) -> list[int]:
        out = [int(np.argmax(self.prefill(prompt)[-1]))]
        for i in range(steps - 1):
            out.append(int(np.argmax(self.decode(out[-1], len(prompt) + i)[0])))
        return out


def top_logprobs(logits: np.ndarray, k: int = 8) -> list[dict]:
    """Each row's top-k (ids, log-probabilities), as LocalEngine.score gives them."""
    lp = logits.astype(np.float64)
    lp = lp - lp.max(axis=1, keepdims=True)
    lp -= np.log(np.exp(lp).sum(axis=1, keepdims=True))
    ids = np.argsort(-lp, axis=1, kind="stable")[:, :k]
    return [{"top_ids": i.tolist(), "top_logprobs": np.take(r, i).tolist()} for i, r in zip(ids, lp)]
