"""SGLang's LowConfidence dLLM algorithm: commit every masked position of the block whose drawn
token's probability is >= threshold, and at least the most probable one (ties: lower position)."""
from __future__ import annotations

import numpy as np

from shared.diffusion_params import DiffusionParams
from worker.diffusion.base import DiffusionRandom, DiffusionSampler, PositionDraws, best_first


class LowConfidenceSampler(DiffusionSampler):
    names = ("low_confidence",)

    def commit_draws(self, draws: PositionDraws, transfer_count: int, params: DiffusionParams,
                     rng: DiffusionRandom) -> tuple[np.ndarray, np.ndarray]:
        if not len(draws.tokens):
            return np.zeros(0, np.int64), np.zeros(0, np.int64)
        chosen = np.flatnonzero(draws.probability >= np.float32(params.threshold))
        if not len(chosen):
            chosen = best_first(draws.probability)[:1]
        return chosen, draws.tokens[chosen]
