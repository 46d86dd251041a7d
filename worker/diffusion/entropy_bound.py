"""The entropy-bounded sampler (SGLang's dLLM EntropyBound, after "Accelerated Sampling from Masked
Diffusion Models via Entropy Bounded Unmasking"): commit the masked positions of lowest entropy,
in that order, while their summed entropy stays <= gamma, and at least one (ties: lower position)."""
from __future__ import annotations

import numpy as np

from shared.diffusion_params import DiffusionParams
from worker.diffusion.base import DiffusionRandom, DiffusionSampler, PositionDraws, best_first


class EntropyBoundSampler(DiffusionSampler):
    names = ("entropy_bound",)

    def commit_draws(self, draws: PositionDraws, transfer_count: int, params: DiffusionParams,
                     rng: DiffusionRandom) -> tuple[np.ndarray, np.ndarray]:
        if not len(draws.tokens):
            return np.zeros(0, np.int64), np.zeros(0, np.int64)
        order = best_first(-draws.entropy)                       # lowest entropy first
        within = np.cumsum(draws.entropy[order].astype(np.float64)) <= params.gamma
        count = max(1, int(np.argmin(within)) if not within.all() else len(order))
        chosen = order[:count]
        return chosen, draws.tokens[chosen]
