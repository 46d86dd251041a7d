"""One engine step of text-diffusion canvases in the worker: every canvas of the step in one
non-causal forward (worker/models/llada.py packs them, its products canvas by canvas), then each
canvas's sampler commits positions of its current block, or, for a scoring chunk, the top-k of
every position's own logits."""
from __future__ import annotations

import numpy as np

from kernels import AttentionMetadata, Backend
from shared.model_config import ModelConfig
from shared.step import SeqChunk, SeqResult, StepResult
from worker.diffusion import DiffusionRandom, sampler_for
from worker.models import ForwardInput, Model


class CanvasStep:
    def __init__(self, model: Model, ops: Backend, config: ModelConfig):
        self.model, self.ops, self.config = model, ops, config
        self._random: dict[int, DiffusionRandom] = {}     # per sequence, across its steps
        self.forwards = 0                                  # forward passes run (observable by tests)

    def forget(self, seq_id: int) -> None:
        self._random.pop(seq_id, None)

    def logit_row(self, positions: np.ndarray) -> np.ndarray:
        """The row of a canvas whose logits predict each position (llama.cpp's get_logits_for_pos)."""
        if self.config.shift_logits:
            return np.maximum(positions - 1, 0)
        return positions

    def execute(self, chunks: list[SeqChunk]) -> StepResult:
        for c in chunks:
            if c.start_pos != 0:
                raise ValueError(f"sequence {c.seq_id}: a diffusion canvas is run whole from position 0 "
                                 f"(start_pos {c.start_pos})")
            if c.diffusion is None and not c.score_top_k:
                raise ValueError(f"sequence {c.seq_id}: {self.config.architecture} is a text-diffusion model; "
                                 "its chunks are canvases to denoise (diffusion) or to score (score_top_k)")
        tokens = [np.asarray(c.token_ids, np.int64) for c in chunks]
        lens = np.array([len(t) for t in tokens], np.int64)
        starts = np.cumsum(lens) - lens
        # per chunk, the canvas positions whose logits it reads
        wanted = []
        for c, t in zip(chunks, tokens):
            if c.diffusion is not None:
                d = c.diffusion
                block = np.arange(d.block_start, min(d.block_end, len(t)))
                wanted.append(block[t[block] == self.config.mask_token_id])
            else:
                wanted.append(np.arange(len(t)))
        output_rows = np.concatenate([s + self.logit_row(w) for s, w in zip(starts, wanted)]).astype(np.int64)
        meta = AttentionMetadata(lens, lens, np.zeros((len(chunks), 0), np.int32), np.zeros(0, np.int64), causal=False)
        inp = ForwardInput(np.concatenate(tokens), np.concatenate([np.arange(n) for n in lens]), meta, output_rows)
        self.ops.begin_pass(int(lens.sum()))
        hidden = self.ops.run_forward(self.model, inp)
        self.forwards += 1
        results, row = [], 0
        for c, w in zip(chunks, wanted):
            h = hidden[row:row + len(w)]
            row += len(w)
            results.append(self._score(c, h) if c.diffusion is None else self._commit(c, w, h))
        return StepResult(results, int(lens.sum()))

    def _logits(self, hidden: np.ndarray) -> np.ndarray:
        if not len(hidden):
            return np.zeros((0, self.config.vocab_size), np.float32)
        self.ops.begin_pass(len(hidden))
        return self.ops.to_numpy(self.model.logits(hidden))

    def _commit(self, c: SeqChunk, masked: np.ndarray, hidden: np.ndarray) -> SeqResult:
        d = c.diffusion
        rng = self._random.get(c.seq_id)
        if rng is None:
            rng = self._random[c.seq_id] = DiffusionRandom(d.params.seed)
        chosen, ids = sampler_for(d.params.algorithm).commit(self._logits(hidden), d.transfer_count, d.params, rng)
        return SeqResult(c.seq_id, committed_positions=masked[chosen].astype(np.int64),
                         committed_ids=np.asarray(ids, np.int64))

    def _score(self, c: SeqChunk, hidden: np.ndarray) -> SeqResult:
        logprobs = self.ops.log_softmax(self._logits(hidden))
        ids, lps = self.ops.top_k(logprobs, c.score_top_k)
        return SeqResult(c.seq_id, score_ids=self.ops.to_numpy(ids), score_logprobs=self.ops.to_numpy(lps))
