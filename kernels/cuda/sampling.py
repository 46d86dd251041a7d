"""Launchers of kernels/cuda/sampling.cu: greedy and sampled token choice on the device, only the
chosen ids copied back.

The sampler draws from its own counter-based stream (quant_blocks.cuh's ts_uniform(seed,
counter)): a seeded request is reproducible on this backend whatever it is batched with, but its
tokens are not those of the CPU worker's numpy generator."""
from __future__ import annotations

from typing import Any

import numpy as np

from kernels.cuda.modules import Modules


class SamplingOps:
    def __init__(self, cp: Any, modules: Modules) -> None:
        self.cp, self.modules = cp, modules

    def argmax(self, logits: Any) -> np.ndarray:
        """int64 [rows]: each row's first largest logit, -1 for a row with a NaN or infinite logit."""
        cp = self.cp
        logits = cp.ascontiguousarray(logits, dtype=cp.float32)
        out = cp.empty(logits.shape[0], cp.int64)
        if logits.shape[0]:
            self.modules.function("sampling", "argmax_rows")((logits.shape[0],), (256,),
                                                              (logits, np.int32(logits.shape[1]), out))
        return cp.asnumpy(out)

    def sample(self, logits: Any, temperature: np.ndarray, top_k: np.ndarray, top_p: np.ndarray,
               seeds: np.ndarray, counters: np.ndarray) -> np.ndarray:
        """int64 [rows]: a token per row, greedy where temperature <= 0, else drawn from the row's
        softmax at that temperature restricted to its top_k (<= 0: all) and top_p (>= 1: all)."""
        cp = self.cp
        logits = cp.ascontiguousarray(logits, dtype=cp.float32)
        rows, vocab = logits.shape
        temperature = np.asarray(temperature, np.float32).reshape(rows)
        out = self.argmax(logits)
        drawn = np.flatnonzero(temperature > 0)
        if not drawn.size:
            return out
        sub = logits[cp.asarray(drawn)]
        ids = cp.argsort(-sub, axis=1)              # best first; ties in index order are not promised
        vals = cp.take_along_axis(sub, ids, axis=1)
        picked = cp.empty(drawn.size, cp.int64)
        self.modules.function("sampling", "sample_sorted")(
            (drawn.size,), (256,),
            (cp.ascontiguousarray(vals), cp.ascontiguousarray(ids.astype(cp.int64)), np.int32(vocab),
             cp.asarray(temperature[drawn]), cp.asarray(np.asarray(top_k, np.int32).reshape(rows)[drawn]),
             cp.asarray(np.asarray(top_p, np.float32).reshape(rows)[drawn]),
             cp.asarray(np.asarray(seeds, np.uint64).reshape(rows)[drawn]),
             cp.asarray(np.asarray(counters, np.uint64).reshape(rows)[drawn]),
             cp.empty((drawn.size, vocab), cp.float32), picked))
        out[drawn] = cp.asnumpy(picked)
        return out
