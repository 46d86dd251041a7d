"""Token sampling on the worker (numpy only).

Processing order per row, as in vLLM / llama.cpp:

    penalties -> temperature -> top-k -> top-p -> min-p -> draw

* penalties: repetition penalty over prompt+output tokens (vLLM: positive
  logits are divided by the penalty, negative ones multiplied), then OpenAI
  frequency / presence penalties over generated tokens only
  (``logit -= count * frequency + (count > 0) * presence``).
* greedy rows (temperature < 1e-5) take the argmax of the penalized logits,
  ties going to the lowest token id; they consume no randomness.
* top-k uses ``np.argpartition`` (no full sort of the vocabulary); top-p sorts
  only the candidates: after top-k, or — without top-k — the smallest of the
  top-256 / 4096 / 65536 / all tokens that already hold mass >= top_p.  The
  kept set is the smallest prefix (by descending probability, ties by lowest
  id) whose mass is >= top_p.
* min-p keeps tokens with ``p >= min_p * p_max`` (p of the temperature-scaled
  distribution; truncation does not change the ratio).
* the draw is an inverse-CDF on exactly one ``generator.random()`` per row, so a
  seeded request is reproducible regardless of what else is in the batch.

Reported logprobs are those of the model's *raw* distribution
(log_softmax of the unprocessed logits, vLLM's default), computed only for rows
whose ``params.logprobs`` is set (0 = the chosen token's alone, n = also the
top-n tokens, best first), as vLLM does: the log-sum-exp over a 262144-token
vocabulary took 0.37 ms cold on a Zen 4 core (docs/BENCHMARKS.md).  Other rows report NaN.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from kernels.cpu import elementwise
from shared.sampling_params import SamplingParams

__all__ = [
    "SampleOutput",
    "Sampler",
    "make_generator",
    "apply_penalties",
    "truncated_distribution",
    "log_softmax",
]

# Candidate-set sizes tried for top-p without top-k before falling back to a
# full sort of the vocabulary.
_TOP_P_STEPS = (256, 4096, 65536)
# Bound on temporary memory for batched log-softmax (elements per chunk).
_CHUNK_ELEMS = 1 << 23


def make_generator(seed: int | None) -> np.random.Generator:
    """Per-sequence RNG: seeded (``np.random.default_rng(seed)``) or fresh entropy.

    Negative seeds (allowed by the OpenAI API) are mapped into [0, 2**64).
    """
    if seed is None:
        return np.random.default_rng()
    seed = int(seed)
    if seed < 0:
        seed %= 1 << 64
    return np.random.default_rng(seed)


@dataclass
class SampleOutput:
    token_ids: np.ndarray                 # int64 [n]
    logprobs: np.ndarray                  # float32 [n], raw-distribution logprob of the chosen token (NaN if not requested)
    top_ids: list[np.ndarray | None]      # per row: top-n ids best first, None if logprobs not requested
    top_logprobs: list[np.ndarray | None]  # per row: matching float32 logprobs


# ---------------------------------------------------------------- primitives
def log_softmax(row: np.ndarray) -> np.ndarray:
    """float64 log_softmax of one row (reference helper)."""
    x = np.asarray(row, dtype=np.float64)
    m = x.max()
    return x - (m + np.log(np.exp(x - m).sum()))


def _row_logsumexp(logits: np.ndarray, batch_rows: np.ndarray | None = None) -> np.ndarray:
    """log-sum-exp per row of a float32 [n, V] array, in float64, chunked. `batch_rows`: the
    batch's row number of each row, for the error about a non-finite one."""
    n, v = logits.shape
    out = np.empty(n, dtype=np.float64)
    step = max(1, _CHUNK_ELEMS // max(v, 1))
    for s in range(0, n, step):
        blk = logits[s:s + step]
        m = blk.max(axis=1)
        bad = ~np.isfinite(m)
        if bad.any():
            i = s + int(np.flatnonzero(bad)[0])
            i = int(batch_rows[i]) if batch_rows is not None else i
            raise ValueError(f"logits row {i} has no finite maximum (NaN or all -inf/+inf)")
        if elementwise.available():
            total = elementwise.exp_sums(blk, m)
        else:
            total = np.exp(blk - m[:, None]).sum(axis=1, dtype=np.float64)
        out[s:s + step] = m.astype(np.float64) + np.log(total)
    return out


@functools.lru_cache(maxsize=64)
def _no_logprobs(n: int) -> np.ndarray:
    """NaN for each of n rows, made once per row count (read only)."""
    out = np.full(n, np.nan, np.float32)
    out.flags.writeable = False
    return out


def _plain_greedy(logits: np.ndarray) -> SampleOutput:
    """Argmax rows without penalties or logprobs: the decode step's common case in a few numpy
    calls, each slow after a step's weight streams have evicted the caches (a 1-element add: 24-38 us)."""
    n = logits.shape[0]
    token_ids = logits.argmax(axis=1)
    for i in range(n):
        # argmax lands on the first NaN or on +inf, and on -inf only when the row is all -inf
        if not math.isfinite(logits[i, token_ids[i]]):
            _check_finite_max(logits[i], i)
    return SampleOutput(token_ids=token_ids, logprobs=_no_logprobs(n),
                        top_ids=[None] * n, top_logprobs=[None] * n)


def _check_finite_max(row: np.ndarray, i: int) -> None:
    if not np.isfinite(row.max()):
        raise ValueError(f"logits row {i} has no finite maximum (NaN or all -inf/+inf)")


def apply_penalties(
    row: np.ndarray,
    params: SamplingParams,
    prompt_tokens: Sequence[int],
    output_tokens: Sequence[int],
) -> np.ndarray:
    """Return a penalized copy of one logits row (vLLM order: repetition, frequency, presence).

    * repetition_penalty r over tokens in prompt ∪ output:
      ``logit / r`` if logit > 0 else ``logit * r``.
    * OpenAI penalties over output tokens only:
      ``logit -= count * frequency_penalty + (count > 0) * presence_penalty``.
    """
    out = np.array(row, dtype=np.float32, copy=True)
    if not params.has_penalties:
        return out
    vocab = out.shape[0]
    outs = np.asarray(output_tokens, dtype=np.int64).reshape(-1)
    outs = outs[(outs >= 0) & (outs < vocab)]
    if params.repetition_penalty != 1.0:
        prm = np.asarray(prompt_tokens, dtype=np.int64).reshape(-1)
        prm = prm[(prm >= 0) & (prm < vocab)]
        seen = np.unique(np.concatenate([prm, outs]))
        if seen.size:
            r = np.float32(params.repetition_penalty)
            vals = out[seen]
            out[seen] = np.where(vals > 0, vals / r, vals * r)
    if (params.frequency_penalty != 0.0 or params.presence_penalty != 0.0) and outs.size:
        ids, counts = np.unique(outs, return_counts=True)
        delta = counts * params.frequency_penalty + params.presence_penalty
        out[ids] -= delta.astype(np.float32)
    return out


def _sort_desc(ids: np.ndarray, vals: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Sort candidates by descending value, ties by ascending id."""
    order = np.lexsort((ids, -vals))
    return ids[order], vals[order]


def truncated_distribution(
    scaled: np.ndarray, top_k: int, top_p: float, min_p: float
) -> tuple[np.ndarray, np.ndarray]:
    """Apply top-k -> top-p -> min-p to temperature-scaled logits of one row.

    Returns ``(ids, weights)``: candidate token ids (int64) and their
    *unnormalized* float64 probabilities ``exp(logit - max)`` (all > 0).  The
    order is deterministic for a given row.  Divide by ``weights.sum()`` to get
    the final sampling distribution.
    """
    vocab = scaled.shape[0]
    ids: np.ndarray | None = None            # None => the whole vocabulary
    vals = scaled
    if 0 < top_k < vocab:
        ids = np.argpartition(-scaled, top_k - 1)[:top_k]
        vals = scaled[ids]

    m = vals.max()
    if top_p < 1.0:
        w_all = np.exp((vals - m).astype(np.float64))
        total = w_all.sum()
        target = top_p * total
        n = w_all.shape[0]
        cand = None
        for size in _TOP_P_STEPS:
            if size >= n:
                break
            part = np.argpartition(-w_all, size - 1)[:size]
            if w_all[part].sum() >= target:
                cand = part
                break
        if cand is None:
            cand = np.arange(n)
        cids = cand if ids is None else ids[cand]
        cids, cw = _sort_desc(cids, w_all[cand])
        excl = np.cumsum(cw) - cw             # mass strictly before each token
        keep = max(1, int(np.searchsorted(excl, target, side="left")))
        ids, w = cids[:keep], cw[:keep]
    else:
        if ids is None:
            ids = np.arange(vocab, dtype=np.int64)
        w = np.exp((vals - m).astype(np.float64))

    if min_p > 0.0:
        # w is exp(logit - max) with the max always kept, so w == p / p_max.
        mask = w >= min_p
        ids, w = ids[mask], w[mask]

    nz = w > 0.0
    if not nz.all():
        ids, w = ids[nz], w[nz]
    return ids.astype(np.int64, copy=False), w


def _draw(ids: np.ndarray, w: np.ndarray, gen: np.random.Generator) -> int:
    """Inverse-CDF draw using exactly one uniform from ``gen``."""
    u = gen.random()
    if ids.shape[0] == 1:
        return int(ids[0])
    cdf = np.cumsum(w)
    j = int(np.searchsorted(cdf, u * cdf[-1], side="right"))
    return int(ids[min(j, ids.shape[0] - 1)])


def _top_n(row: np.ndarray, lse: float, n: int) -> tuple[np.ndarray, np.ndarray]:
    vocab = row.shape[0]
    n = min(n, vocab)
    if n <= 0:
        return np.empty(0, np.int64), np.empty(0, np.float32)
    ids = np.argpartition(-row, n - 1)[:n] if n < vocab else np.arange(vocab)
    ids, vals = _sort_desc(ids.astype(np.int64), row[ids])
    return ids, (vals.astype(np.float64) - lse).astype(np.float32)


# ------------------------------------------------------------------- sampler
class Sampler:
    """Stateless batch sampler; per-sequence randomness comes from ``generators``."""

    def __init__(self) -> None:
        # Used only for rows whose caller passed no generator.
        self._fallback = np.random.default_rng()

    def sample(
        self,
        logits: np.ndarray,
        params: list[SamplingParams],
        prompt_tokens: list[Sequence[int]],
        output_tokens: list[Sequence[int]],
        generators: list[np.random.Generator | None],
        argmax: np.ndarray | None = None,
    ) -> SampleOutput:
        """`argmax`: each row's first largest logit where the backend computed it with the logits
        (-1 for a row with a NaN or infinite logit); greedy rows without penalties take it."""
        n = len(params)
        if argmax is not None and len(argmax) == n == len(logits) and all(p.plain_greedy for p in params) \
                and min(argmax.tolist()) >= 0:      # first: a decode step's common case, little cold Python
            return SampleOutput(token_ids=argmax, logprobs=_no_logprobs(n), top_ids=[None] * n,
                                top_logprobs=[None] * n)
        logits = np.asarray(logits, dtype=np.float32)
        if logits.ndim == 1:
            logits = logits[None, :]
        if logits.ndim != 2:
            raise ValueError(f"logits must be [n, vocab], got shape {logits.shape}")
        n, vocab = logits.shape
        for name, seq in (("params", params), ("prompt_tokens", prompt_tokens),
                          ("output_tokens", output_tokens), ("generators", generators)):
            if len(seq) != n:
                raise ValueError(f"{name} has {len(seq)} entries for {n} logits rows")

        if all(p.plain_greedy for p in params):
            return _plain_greedy(logits)
        wanted = np.fromiter((p.logprobs is not None for p in params), dtype=bool, count=n)
        lse = np.full(n, np.nan)
        if wanted.all():
            lse[:] = _row_logsumexp(logits)  # also rejects NaN / non-finite rows
        elif wanted.any():
            w_rows = np.flatnonzero(wanted)
            lse[w_rows] = _row_logsumexp(logits[w_rows], w_rows)

        # Penalties (only rows that have any), otherwise share the raw rows.
        pen_rows = [i for i, p in enumerate(params) if p.has_penalties]
        if pen_rows:
            work = logits.copy()
            for i in pen_rows:
                work[i] = apply_penalties(logits[i], params[i], prompt_tokens[i], output_tokens[i])
        else:
            work = logits

        token_ids = np.empty(n, dtype=np.int64)
        greedy = np.fromiter((p.greedy for p in params), dtype=bool, count=n)
        if greedy.all():
            token_ids[:] = np.argmax(work, axis=1)     # first max => lowest id
        elif greedy.any():
            g = np.flatnonzero(greedy)
            token_ids[g] = np.argmax(work[g], axis=1)

        for i in np.flatnonzero(~greedy):
            p = params[i]
            if not wanted[i]:
                _check_finite_max(work[i], int(i))
            scaled = work[i] / np.float32(p.temperature) if p.temperature != 1.0 else work[i]
            ids, w = truncated_distribution(scaled, p.top_k, p.top_p, p.min_p)
            gen = generators[i] if generators[i] is not None else self._fallback
            token_ids[i] = _draw(ids, w, gen)

        rows = np.arange(n)
        picked = logits[rows, token_ids]
        for i in np.flatnonzero(greedy & ~wanted):
            # argmax lands on the first NaN or on +inf, and on -inf only when the row is all -inf
            if not np.isfinite(work[i, token_ids[i]]):
                _check_finite_max(work[i], int(i))
        chosen = (picked.astype(np.float64) - lse).astype(np.float32)

        top_ids: list[np.ndarray | None] = [None] * n
        top_lps: list[np.ndarray | None] = [None] * n
        for i, p in enumerate(params):
            if p.logprobs is not None:
                top_ids[i], top_lps[i] = _top_n(logits[i], float(lse[i]), p.logprobs)

        return SampleOutput(token_ids=token_ids, logprobs=chosen,
                            top_ids=top_ids, top_logprobs=top_lps)
