"""Diffusion sampling in the worker: turning a canvas's logits into committed (position, token)
pairs. One module per algorithm family, chosen by the request's algorithm name."""
from __future__ import annotations

from worker.diffusion.base import DiffusionRandom, DiffusionSampler
from worker.diffusion.entropy_bound import EntropyBoundSampler
from worker.diffusion.llama_cpp import OriginSampler, RankedSampler
from worker.diffusion.low_confidence import LowConfidenceSampler

SAMPLERS: dict[str, DiffusionSampler] = {
    name: sampler for sampler in (RankedSampler(), OriginSampler(), LowConfidenceSampler(), EntropyBoundSampler())
    for name in sampler.names}


def sampler_for(algorithm: str) -> DiffusionSampler:
    sampler = SAMPLERS.get(algorithm)
    if sampler is None:
        raise ValueError(f"unknown diffusion algorithm {algorithm!r} (known: {', '.join(SAMPLERS)})")
    return sampler


__all__ = ["DiffusionRandom", "DiffusionSampler", "SAMPLERS", "sampler_for"]
