"""The block schedule of one diffusion request, llama.cpp's (examples/diffusion/diffusion.cpp,
DIFFUSION_TRANSFER_SCHEDULE_BLOCK_BASED): the canvas is prompt + gen_length tokens, cut into
(prompt + gen_length) / block_length blocks, block b covering
[n_prompt + b * block_length, min(n_prompt + (b + 1) * block_length, total)) (late blocks may be
short or empty). With llama.cpp's algorithms each block gets steps / n_blocks steps and its masked
count m is spread over them as m // steps tokens a step, the first m % steps steps one more; with
the threshold algorithms (low_confidence, entropy_bound) a block takes steps until it has no mask
left, each committing what the worker's sampler decides (at least one position)."""
from __future__ import annotations

from shared.diffusion_params import DiffusionParams


class BlockSchedule:
    def __init__(self, n_prompt: int, params: DiffusionParams):
        params.validate(n_prompt)
        self.params = params
        self.total = n_prompt + params.gen_length
        n_blocks = params.blocks(n_prompt)
        b = params.block_length
        self.blocks = [(min(n_prompt + i * b, self.total), min(n_prompt + (i + 1) * b, self.total))
                       for i in range(n_blocks)]
        self.steps_per_block = params.steps // n_blocks if params.fixed_counts else 0

    @staticmethod
    def transfer_counts(mask_count: int, steps: int) -> list[int]:
        """llama.cpp's get_num_transfer_tokens."""
        base, extra = divmod(mask_count, steps)
        return [base + (1 if i < extra else 0) for i in range(steps)]
