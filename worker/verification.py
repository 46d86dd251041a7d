"""Verifying drafted tokens (speculative decoding) against the target model's logits.

A chunk [last, d1..dk] gives k + 1 logits rows: row j is the model's next-token distribution
after d_j (row 0 after the last real token). Each row is processed as the plain sampler
processes one (penalties over the history up to that row, temperature, top-k/p, min-p):

* greedy: d_{j+1} is accepted while it is the row's argmax; the first mismatch emits the argmax
  instead, and when all k match, row k's argmax is the bonus token. The output is the plain
  greedy output token for token.
* sampled: rejection sampling with the draft as a one-hot proposal (an n-gram draft has no
  distribution of its own): d accepted with probability p(d); on rejection the token is drawn
  from p with d removed and renormalised, so each emitted token is distributed exactly as p
  (p(x) = p(d)·[x = d] + (1 - p(d))·p(x)/(1 - p(d))·[x ≠ d]); all k accepted, the bonus is drawn
  from row k. Randomness comes from the sequence's own generator, seeded by its request.

Requests with logprobs are not drafted (the scheduler's choice), so logprobs here are NaN.
"""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from shared.sampling_params import SamplingParams
from worker.sampling import _check_finite_max, _draw, apply_penalties, truncated_distribution

__all__ = ["verify_drafts"]


def verify_drafts(logits: np.ndarray, drafts: Sequence[int], params: SamplingParams,
                  prompt_tokens: Sequence[int], output_tokens: Sequence[int],
                  generator: np.random.Generator) -> tuple[list[int], int]:
    """(accepted drafts, the token after them). `logits`: [len(drafts) + 1, vocab]; `output_tokens`:
    the generated tokens up to and including the chunk's first input (the drafts are added row by
    row, as the plain path would have them by then)."""
    drafts = [int(d) for d in drafts]
    if logits.shape[0] != len(drafts) + 1:
        raise ValueError(f"{len(drafts)} drafted tokens need {len(drafts) + 1} logits rows, got {logits.shape[0]}")
    history = list(output_tokens) if params.has_penalties else []
    accepted: list[int] = []
    for j in range(len(drafts) + 1):
        row = logits[j]
        if params.has_penalties:
            row = apply_penalties(row, params, prompt_tokens, history)
        draft = drafts[j] if j < len(drafts) else None
        token = _choose(row, params, draft, generator, j)
        if token != draft:
            return accepted, token
        accepted.append(token)
        history.append(token)
    raise AssertionError("unreachable: the last row has no draft to match")


def _choose(row: np.ndarray, params: SamplingParams, draft: int | None,
            generator: np.random.Generator, j: int) -> int:
    """`draft` when it is accepted at this row, else the token emitted instead (draft None: the
    bonus row, a plain draw)."""
    if params.greedy:
        token = int(np.argmax(row))        # first max: lowest id, as the plain sampler
        if not math.isfinite(row[token]):
            _check_finite_max(row, j)
        return token
    _check_finite_max(row, j)
    scaled = row / np.float32(params.temperature) if params.temperature != 1.0 else row
    ids, w = truncated_distribution(scaled, params.top_k, params.top_p, params.min_p)
    if draft is None:
        return _draw(ids, w, generator)
    at = np.flatnonzero(ids == draft)
    p_draft = float(w[at[0]] / w.sum()) if len(at) else 0.0
    if generator.random() < p_draft:
        return draft
    keep = ids != draft                    # p_draft < 1 here, so something is left
    return _draw(ids[keep], w[keep], generator)
