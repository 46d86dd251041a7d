"""One engine step of text-diffusion canvases in the worker: every canvas of the step in one
non-causal forward (worker/models/llada.py packs them), then each canvas's sampler commits positions
of its current block, or, for a scoring chunk, the top-k of every position's own logits.

Where the model's products are row-invariant (`LladaModel.rowwise`) the logits of every canvas's
rows come from one head product, and the canvases whose draws follow from a few statistics of the
logits (`from_stats_only`: temperature 0) get them from one compiled pass over their rows
(kernels/cpu/logit_stats.py) instead of softmax arrays of the whole vocabulary; either way a row's
result does not depend on the canvases beside it."""
from __future__ import annotations

import numpy as np

from kernels import AttentionMetadata, Backend
from kernels.cpu import logit_stats
from shared.model_config import ModelConfig
from shared.step import SeqChunk, SeqResult, StepResult
from worker.diffusion import DiffusionRandom, sampler_for
from worker.diffusion.base import draws_from_stats, from_stats_only, stats_needed
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
        ends = np.cumsum([len(w) for w in wanted])
        spans = [(int(e) - len(w), int(e)) for e, w in zip(ends, wanted)]
        if getattr(self.model, "rowwise", False):
            per_chunk = self._rowwise_heads(chunks, spans, hidden)
        else:        # the head canvas by canvas, as the products
            per_chunk = [(self._logits(hidden[a:b]), None) for a, b in spans]
        results = []
        for c, w, (lg, st) in zip(chunks, wanted, per_chunk):
            results.append(self._score(c, lg) if c.diffusion is None else self._commit(c, w, lg, st))
        return StepResult(results, int(lens.sum()))

    def _logits(self, hidden: np.ndarray) -> np.ndarray:
        if not len(hidden):
            return np.zeros((0, self.config.vocab_size), np.float32)
        self.ops.begin_pass(len(hidden))
        return self.ops.to_numpy(self.model.logits(hidden))

    def _rowwise_heads(self, chunks: list[SeqChunk], spans: list[tuple[int, int]], hidden: np.ndarray
                       ) -> list[tuple[np.ndarray | None, tuple | None]]:
        """(logits, statistics) of each chunk's rows, every row computed as alone: the chunks whose
        draws follow from statistics (`from_stats_only`) get them from the head in one compiled pass
        per kind of statistics (the backend's `head_stats`, else from their logits); the others get
        their logits from one head product."""
        out: list[tuple[np.ndarray | None, tuple | None]] = [(None, None)] * len(chunks)
        groups: dict[tuple[bool, bool, bool], list[int]] = {}
        if logit_stats.available():
            for i, c in enumerate(chunks):
                if c.diffusion is not None and from_stats_only(c.diffusion.params) and spans[i][1] > spans[i][0]:
                    groups.setdefault(stats_needed(c.diffusion.params), []).append(i)
        head_stats = getattr(self.ops, "head_stats", None)
        fused = set()
        for needs, members in groups.items():
            rows = np.concatenate([np.arange(*spans[i]) for i in members])
            values = head_stats(hidden[rows], self.model.output, *needs) if head_stats is not None else None
            if values is None:
                continue
            fused.update(members)
            at = 0
            for i in members:
                n = spans[i][1] - spans[i][0]
                out[i] = (None, tuple(v[at:at + n] for v in values))
                at += n
        rest = [i for i in range(len(chunks)) if i not in fused]
        if rest:
            rows = np.concatenate([np.arange(*spans[i]) for i in rest])
            logits = self._logits(hidden[rows])
            at = 0
            for i in rest:
                n = spans[i][1] - spans[i][0]
                lg = logits[at:at + n]
                at += n
                stats = None
                if any(i in members for members in groups.values()):      # statistics from the logits
                    stats = logit_stats.row_stats(lg, None, *stats_needed(chunks[i].diffusion.params))
                out[i] = (lg, stats)
        return out

    def _commit(self, c: SeqChunk, masked: np.ndarray, logits: np.ndarray, stats: tuple | None) -> SeqResult:
        d = c.diffusion
        rng = self._random.get(c.seq_id)
        if rng is None:
            rng = self._random[c.seq_id] = DiffusionRandom(d.params.seed)
        sampler = sampler_for(d.params.algorithm)
        if stats is not None:
            chosen, ids = sampler.commit_draws(draws_from_stats(*stats, d.params), d.transfer_count, d.params, rng)
        else:
            chosen, ids = sampler.commit(logits, d.transfer_count, d.params, rng)
        return SeqResult(c.seq_id, committed_positions=masked[chosen].astype(np.int64),
                         committed_ids=np.asarray(ids, np.int64))

    def _score(self, c: SeqChunk, logits: np.ndarray) -> SeqResult:
        logprobs = self.ops.log_softmax(logits)
        ids, lps = self.ops.top_k(logprobs, c.score_top_k)
        return SeqResult(c.seq_id, score_ids=self.ops.to_numpy(ids), score_logprobs=self.ops.to_numpy(lps))
