"""What a diffusion sampler is: from the logits of a canvas's masked positions in its current block,
which positions to commit this step and with which tokens.

Every algorithm first draws a token for each masked position the way llama.cpp's
`diffusion_generate` does, through the sampler chain of its CLI (top-k, top-p, temperature, then
`dist`), and then ranks the positions by its own score. At temperature 0 a position's token is its
argmax and its probability the softmax over the candidates left by top-k/top-p (the whole
vocabulary when neither is set). Randomness comes from the request's seed through two Mersenne
Twisters seeded as llama.cpp seeds `std::mt19937`: one for the chain's `dist` sampler, one for the
algorithms (random confidences, origin's coin flips), each drawing floats as libstdc++'s
`generate_canonical` does.

At temperature 0 without top-p, and with top-k off or 1, a position's draw depends only on a few
statistics of its logits (`stats_needed`: its argmax always; the sum of exp(l - max) for a
probability; the runner-up for a margin; sum(exp(l - max) * (l - max)) for an entropy, which is
then log(S) - that / S, the eps of llama.cpp's p * log(p + eps) left out: at most vocab * eps).
The worker computes just those for the masked rows of every canvas of a step in one compiled pass
(kernels/cpu/logit_stats.py) and hands samplers `PositionDraws` (`draws_from_stats`) instead of
logits: `DiffusionSampler.commit_draws`.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from shared.diffusion_params import DiffusionParams

ENTROPY_EPSILON = 1e-10     # llama.cpp's calculate_confidence: -sum p log(p + eps)


class MersenneTwister:
    """std::mt19937(seed) and libstdc++'s uniform_real_distribution<float|double>(0, 1) over it."""

    def __init__(self, seed: int):
        self._bits = np.random.MT19937()
        self._bits.state = np.random.RandomState(int(seed) % 2**32).get_state(legacy=False)

    def uniform_float(self) -> float:
        value = np.float32(self._bits.random_raw()) / np.float32(2.0**32)
        return float(value) if value < 1 else float(np.nextafter(np.float32(1), np.float32(0)))

    def uniform_double(self) -> float:
        low, high = self._bits.random_raw(2).tolist()
        value = (float(low) + float(high) * 2.0**32) / 2.0**64
        return value if value < 1 else float(np.nextafter(1.0, 0.0))


class DiffusionRandom:
    """A sequence's random state across its steps (worker-side, dropped when it finishes)."""

    def __init__(self, seed: int):
        self.dist = MersenneTwister(seed)         # the sampler chain's dist sampler
        self.algorithm = MersenneTwister(seed)    # diffusion_generate's own rng


@dataclass
class PositionDraws:
    """One token drawn at each masked position, with what the algorithms rank them by."""
    tokens: np.ndarray        # int64 [m]
    probability: np.ndarray   # float32 [m]: the drawn token's probability among the candidates
    entropy: np.ndarray       # float32 [m]: of the candidates' distribution
    margin: np.ndarray        # float32 [m]: best candidate's probability minus the second's


def _candidates(logits: np.ndarray, params: DiffusionParams) -> tuple[np.ndarray, np.ndarray]:
    """(ids, logits) of one position's candidates after top-k and top-p, best first when either
    filtered (llama.cpp sorts them then), in id order otherwise. Ties: the lower id first."""
    ids = np.arange(logits.shape[0])
    vals = logits
    if 0 < params.top_k < len(ids):
        ids = np.argpartition(-logits, params.top_k - 1)[:params.top_k]
    if params.top_k > 0 or params.top_p < 1.0:
        ids = ids[np.lexsort((ids, -logits[ids]))]
        vals = logits[ids]
    if params.top_p < 1.0 and len(ids) > 1:
        p = _softmax(vals)
        keep = int(np.searchsorted(np.cumsum(p, dtype=np.float64), params.top_p)) + 1
        ids, vals = ids[:keep], vals[:keep]
    return ids, vals


def _softmax(vals: np.ndarray) -> np.ndarray:
    """llama.cpp's: expf of each logit less the largest in float32, their sum in double."""
    e = np.exp((vals - vals.max()).astype(np.float32))
    return (e / e.sum(dtype=np.float64)).astype(np.float32)


def _stats(p: np.ndarray) -> tuple[float, float]:
    entropy = -float(np.sum(p * np.log(p + np.float32(ENTROPY_EPSILON)), dtype=np.float32))
    if len(p) == 1:
        return entropy, float(p[0])
    top2 = np.partition(p, len(p) - 2)[-2:]
    return entropy, float(top2[1] - top2[0])


def draw_one(logits: np.ndarray, params: DiffusionParams, rng: DiffusionRandom) -> tuple[int, float, float, float]:
    """(token, probability, entropy, margin) of one position through the sampler chain."""
    ids, vals = _candidates(logits, params)
    if params.temperature <= 0.0:
        p = _softmax(vals)
        best = int(np.argmax(vals))
        return int(ids[best]), float(p[best]), *_stats(p)
    vals = (vals / np.float32(params.temperature)).astype(np.float32)
    p = _softmax(vals)
    target = rng.dist.uniform_double()        # llama.cpp draws once even for one candidate
    running = np.cumsum(np.exp((vals - vals.max()).astype(np.float32)), dtype=np.float64)   # in order, as llama.cpp
    chosen = int(np.searchsorted(running, running[-1] * target))
    chosen = min(chosen, len(ids) - 1)
    return int(ids[chosen]), float(p[chosen]), *_stats(p)


def draw_positions(logits: np.ndarray, params: DiffusionParams, rng: DiffusionRandom) -> PositionDraws:
    """Draw every row of `logits` ([m, vocab], masked positions in order)."""
    m = logits.shape[0]
    if params.temperature <= 0.0 and params.top_k <= 0 and params.top_p >= 1.0 and m:
        # the whole vocabulary at once: argmax and softmax statistics row by row
        tokens = np.argmax(logits, axis=1)
        shifted = (logits - logits.max(axis=1, keepdims=True)).astype(np.float32)
        e = np.exp(shifted)
        p = (e / e.sum(axis=1, keepdims=True, dtype=np.float64)).astype(np.float32)
        entropy = -np.sum(p * np.log(p + np.float32(ENTROPY_EPSILON)), axis=1, dtype=np.float32)
        top2 = np.partition(p, -2, axis=1)[:, -2:] if p.shape[1] > 1 else np.concatenate([p, np.zeros_like(p)], 1)
        return PositionDraws(tokens.astype(np.int64), p[np.arange(m), tokens], entropy.astype(np.float32),
                             (top2[:, 1] - top2[:, 0]).astype(np.float32))
    rows = [draw_one(logits[i], params, rng) for i in range(m)]
    cols = list(zip(*rows)) if rows else [(), (), (), ()]
    return PositionDraws(np.array(cols[0], np.int64), np.array(cols[1], np.float32),
                         np.array(cols[2], np.float32), np.array(cols[3], np.float32))


def from_stats_only(params: DiffusionParams) -> bool:
    """Whether a position's draw is a function of its logits' statistics alone (no sampling chain
    beyond the argmax): temperature 0, top-p off, top-k off or 1."""
    return params.temperature <= 0.0 and params.top_p >= 1.0 and params.top_k in (0, 1)


def stats_needed(params: DiffusionParams) -> tuple[bool, bool, bool]:
    """(sum of exps, runner-up, entropy moment) the algorithm ranks by, for `from_stats_only`
    params: top-k 1 leaves one candidate of probability 1 (entropy 0, margin 1), and random and
    origin read only the tokens."""
    if params.top_k == 1 or params.algorithm in ("random", "origin"):
        return False, False, False
    return True, params.algorithm == "margin", params.algorithm in ("entropy", "entropy_bound")


def draws_from_stats(argmax: np.ndarray, top: np.ndarray, second_exp: np.ndarray, sums: np.ndarray,
                     moments: np.ndarray, params: DiffusionParams) -> PositionDraws:
    """The draws of `from_stats_only` params from kernels/cpu/logit_stats.py's row statistics (what
    `stats_needed` did not ask for is 0)."""
    m = len(argmax)
    need_sum, need_second, need_entropy = stats_needed(params)
    zeros = np.zeros(m, np.float32)
    if params.top_k == 1:      # one candidate: probability 1, entropy -1 * log(1 + eps) = 0, margin p = 1
        ones = np.ones(m, np.float32)
        return PositionDraws(argmax.astype(np.int64), ones, zeros, ones)
    probability = (1.0 / sums).astype(np.float32) if need_sum else zeros     # the argmax's exp is 1
    margin = zeros
    if need_second:
        margin = probability - (second_exp.astype(np.float64) / sums).astype(np.float32)
    entropy = zeros
    if need_entropy:
        entropy = (np.log(sums) - moments / sums).astype(np.float32)
    return PositionDraws(argmax.astype(np.int64), probability, entropy, margin.astype(np.float32))


def best_first(scores: np.ndarray) -> np.ndarray:
    """Indices by score, highest first; ties: the lower index (position) first."""
    return np.lexsort((np.arange(len(scores)), -scores.astype(np.float64)))


class DiffusionSampler:
    """One algorithm family. `commit` gets the logits of the masked positions of a canvas's current
    block ([m, vocab], in position order) and returns (indices into them, tokens) to commit;
    `commit_draws` the same from their draws (`from_stats_only` params)."""
    names: tuple[str, ...] = ()

    def commit(self, logits: np.ndarray, transfer_count: int, params: DiffusionParams,
               rng: DiffusionRandom) -> tuple[np.ndarray, np.ndarray]:
        return self.commit_draws(draw_positions(logits, params, rng), transfer_count, params, rng)

    def commit_draws(self, draws: PositionDraws, transfer_count: int, params: DiffusionParams,
                     rng: DiffusionRandom) -> tuple[np.ndarray, np.ndarray]:
        raise NotImplementedError
