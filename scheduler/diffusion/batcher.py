"""Continuous batching of diffusion requests: every engine step packs the canvas of each running
request into one step request (one forward in the worker, each canvas a non-causal chunk), and
applies what the worker commits. A request joins at the next step after it is added (its first
block's boundary) and leaves when its last block is final; a request's output does not depend on
the others (the worker's products give each row the same bits whatever rows share the call,
kernels/cpu/row_matmul.py, and its randomness is per sequence).

Observing a request: `DiffusionRequest.on_step` after each of its steps (its whole canvas), and
`on_block` when one of its blocks is final; `step()` also returns the requests that finished.
"""
from __future__ import annotations

from collections import deque
from typing import Callable

import numpy as np

from scheduler.diffusion.request import DiffusionRequest, next_seq_id
from shared.step import SeqChunk, StepRequest, StepResult

_NO_BLOCKS = np.zeros(0, np.int32)


class DiffusionBatcher:
    def __init__(self, execute: Callable[[StepRequest], StepResult], max_num_seqs: int = 16,
                 max_num_batched_tokens: int = 8192):
        """`max_num_batched_tokens`: canvas tokens one forward takes at most (a canvas longer than
        that still runs, alone)."""
        self.execute = execute
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.waiting: deque[DiffusionRequest] = deque()
        self.running: list[DiffusionRequest] = []
        self._finished_ids: list[int] = []        # told to the worker with the next step
        self.step_rows: list[list[int]] = []      # canvas lengths of each forward so far (stats, tests)

    def add(self, request: DiffusionRequest) -> None:
        if request.finished:       # nothing to do (every block empty): never reaches the worker
            return
        self.waiting.append(request)

    def abort(self, request: DiffusionRequest) -> None:
        if request in self.waiting:
            self.waiting.remove(request)
        elif request in self.running:
            self.running.remove(request)
            self._finished_ids.append(request.seq_id)
        if request.finish_reason is None:
            request.finish_reason = "abort"

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def step(self) -> list[DiffusionRequest]:
        """One forward over every running canvas; returns the requests that finished in it."""
        self._admit()
        if not self.running:
            return []
        chunks = [SeqChunk(r.seq_id, np.asarray(r.canvas, np.int64), 0, _NO_BLOCKS, len(r.prompt), sample=False,
                           diffusion=r.next_step()) for r in self.running]
        request = StepRequest(chunks, finished=self._finished_ids)
        self._finished_ids = []
        self.step_rows.append([len(c.token_ids) for c in chunks])
        result = self.execute(request)
        by_id = {res.seq_id: res for res in result.results}
        done = []
        for r in self.running:
            r.apply(by_id[r.seq_id])
            if r.finished:
                done.append(r)
        for r in done:
            self.running.remove(r)
            self._finished_ids.append(r.seq_id)
        return done

    def _admit(self) -> None:
        tokens = sum(len(r.canvas) for r in self.running)
        while self.waiting and len(self.running) < self.max_num_seqs:
            n = len(self.waiting[0].canvas)
            if self.running and tokens + n > self.max_num_batched_tokens:
                break
            self.running.append(self.waiting.popleft())
            tokens += n

    def score(self, tokens: list[int], top_k: int) -> list[dict]:
        """Top-k log-probabilities of every position's own logits after one non-causal pass."""
        chunk = SeqChunk(next_seq_id(), np.asarray(tokens, np.int64), 0, _NO_BLOCKS, len(tokens), sample=False,
                         score_top_k=top_k)
        res = self.execute(StepRequest([chunk])).results[0]
        return [{"top_ids": [int(i) for i in ids], "top_logprobs": [float(v) for v in lps]}
                for ids, lps in zip(res.score_ids, res.score_logprobs)]

