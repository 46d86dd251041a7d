"""A diffusion request's life in the scheduler: its canvas, where it is in its block schedule, and
the callbacks through which its progress is observed (the whole canvas after every step; the
tokens of a block when the block becomes final)."""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Callable

from scheduler.diffusion.schedule import BlockSchedule
from shared.diffusion_params import DiffusionParams
from shared.step import DiffusionStep, SeqResult

# far from the autoregressive sequences' ids, should one worker ever see both
_ids = itertools.count(1 << 40)


def next_seq_id() -> int:
    return next(_ids)


@dataclass(eq=False)
class DiffusionRequest:
    prompt: list[int]
    params: DiffusionParams
    mask_token_id: int
    # called after every step the request took part in, with the request (read .canvas)
    on_step: Callable[["DiffusionRequest"], None] | None = None
    # called when a block is final: (request, its first position, its tokens)
    on_block: Callable[["DiffusionRequest", int, list[int]], None] | None = None
    seq_id: int = field(default_factory=next_seq_id)
    canvas: list[int] = field(default_factory=list)
    finish_reason: str | None = None         # "length" when every block is done, "abort"
    steps_taken: int = 0

    def __post_init__(self) -> None:
        self.schedule = BlockSchedule(len(self.prompt), self.params)      # validates
        self.canvas = list(self.prompt) + [self.mask_token_id] * self.params.gen_length
        self.block = 0
        self._block_step = 0
        self._counts: list[int] = []
        self._advance()

    @property
    def output(self) -> list[int]:
        """The canvas after the prompt (llama.cpp's output: mask tokens stay where none was committed)."""
        return self.canvas[len(self.prompt):]

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def next_step(self) -> DiffusionStep:
        start, end = self.schedule.blocks[self.block]
        count = self._counts[self._block_step] if self.params.fixed_counts else -1
        return DiffusionStep(start, end, count, self.params)

    def apply(self, result: SeqResult) -> None:
        """The worker's commits for this step, then the schedule moves on."""
        if result.committed_positions is not None:
            for pos, token in zip(result.committed_positions.tolist(), result.committed_ids.tolist()):
                self.canvas[pos] = token
        self._block_step += 1
        self.steps_taken += 1
        self._advance()
        if self.on_step is not None:
            self.on_step(self)

    def _masks(self, start: int, end: int) -> int:
        return sum(1 for t in self.canvas[start:end] if t == self.mask_token_id)

    def _advance(self) -> None:
        """Close the current block when it is done (no mask left, or its steps spent) and open the
        next that has work; finish after the last. A block with no mask takes no step: llama.cpp
        runs a forward there that changes nothing."""
        while self.block < len(self.schedule.blocks):
            start, end = self.schedule.blocks[self.block]
            masks = self._masks(start, end)
            if self._block_step == 0 and self.params.fixed_counts:
                self._counts = BlockSchedule.transfer_counts(masks, self.schedule.steps_per_block)
            spent = self.params.fixed_counts and self._block_step >= self.schedule.steps_per_block
            if masks and not spent:
                return
            if end > start and self._block_step and self.on_block is not None:
                self.on_block(self, start, self.canvas[start:end])
            self.block += 1
            self._block_step = 0
        self.finish_reason = "length"
