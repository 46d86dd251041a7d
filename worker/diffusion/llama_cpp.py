"""llama.cpp's algorithms (examples/diffusion: DIFFUSION_ALGORITHM_*): the schedule fixes how many
masked positions a step commits (the scheduler sends it as transfer_count); the algorithm ranks
them. `confidence` and `origin` read the drawn token's probability, `entropy` the negated entropy
of the candidates' distribution, `margin` the best probability less the second best, `random`
a uniform draw per position. `origin` instead commits each masked position with probability
transfer_count / m (a coin per position, in position order), drawing its token only then."""
from __future__ import annotations

import numpy as np

from shared.diffusion_params import DiffusionParams
from worker.diffusion.base import DiffusionRandom, DiffusionSampler, PositionDraws, best_first, draw_one


class RankedSampler(DiffusionSampler):
    names = ("confidence", "entropy", "margin", "random")

    def commit_draws(self, draws: PositionDraws, transfer_count: int, params: DiffusionParams,
                     rng: DiffusionRandom) -> tuple[np.ndarray, np.ndarray]:
        if params.algorithm == "confidence":
            scores = draws.probability
        elif params.algorithm == "entropy":
            scores = -draws.entropy          # higher entropy, lower confidence
        elif params.algorithm == "margin":
            scores = draws.margin
        else:
            scores = np.array([rng.algorithm.uniform_float() for _ in range(len(draws.tokens))], np.float32)
        chosen = best_first(scores)[:max(0, transfer_count)]
        return chosen, draws.tokens[chosen]


class OriginSampler(DiffusionSampler):
    names = ("origin",)

    def commit(self, logits: np.ndarray, transfer_count: int, params: DiffusionParams,
               rng: DiffusionRandom) -> tuple[np.ndarray, np.ndarray]:
        chosen = self._coins(logits.shape[0], transfer_count, rng)
        tokens = [draw_one(logits[i], params, rng)[0] for i in chosen]     # drawn only where committed
        return np.array(chosen, np.int64), np.array(tokens, np.int64)

    def commit_draws(self, draws: PositionDraws, transfer_count: int, params: DiffusionParams,
                     rng: DiffusionRandom) -> tuple[np.ndarray, np.ndarray]:
        # from_stats_only params: a draw is the argmax and takes nothing from the dist generator
        chosen = np.array(self._coins(len(draws.tokens), transfer_count, rng), np.int64)
        return chosen, draws.tokens[chosen]

    @staticmethod
    def _coins(m: int, transfer_count: int, rng: DiffusionRandom) -> list[int]:
        p_transfer = np.float32(transfer_count) / np.float32(m) if m else np.float32(0)
        return [i for i in range(m) if rng.algorithm.uniform_float() < p_transfer]
