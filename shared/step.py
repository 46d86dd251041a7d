"""The step contract between scheduler and worker: one packed batch per engine iteration.

These dataclasses are what the scheduler builds and the worker executes; the
gRPC layer (protos/) carries them between processes.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from shared.diffusion_params import DiffusionParams
from shared.sampling_params import SamplingParams


@dataclass
class DiffusionStep:
    """What a diffusion canvas's chunk asks of the worker beyond its forward: the masked positions
    in [block_start, block_end) of the canvas are the candidates; the worker's sampler
    (worker/diffusion/) picks which of them to commit and with what token."""
    block_start: int
    block_end: int
    # llama.cpp's schedule: how many to commit this step (0 commits none but still draws the
    # step's random numbers, as llama.cpp does); -1: the algorithm decides (low_confidence,
    # entropy_bound)
    transfer_count: int
    params: DiffusionParams


@dataclass
class SeqChunk:
    seq_id: int
    token_ids: np.ndarray          # tokens computed this step (a prefill chunk or one decode token)
    start_pos: int                 # position of token_ids[0]
    block_table: np.ndarray        # KV blocks holding positions [0, start_pos + len(token_ids))
    prompt_len: int                # tokens of the sequence that are prompt (for penalties)
    sample: bool = True            # draw the next token after this chunk
    params: SamplingParams | None = None   # needed whenever sample is True
    score_top_k: int = 0           # > 0: top-k logprobs at every position of the chunk (scoring, echo)
    # tokens at positions [0, start_pos) when the worker may not have seen them (a prompt whose
    # prefix came from the prefix cache): penalties need the whole history
    prefix_ids: np.ndarray | None = None
    # with score_top_k: per position, the token whose own logprob is wanted too (the next token of the
    # sequence, which need not be among the top k); -1 where there is none
    score_targets: np.ndarray | None = None
    # > 0: the last num_draft of token_ids are drafted (speculative decoding): the worker verifies
    # them against its own next-token choices at each of the last num_draft + 1 positions and
    # answers with the accepted ones (SeqResult.accepted_ids) and one token of its own after them
    num_draft: int = 0
    # a text-diffusion canvas: token_ids is the whole [prompt | canvas] from position 0, run as one
    # non-causal chunk that needs no KV blocks (block_table empty); the worker answers with the
    # positions it commits (SeqResult.committed_positions / committed_ids). With score_top_k and
    # no diffusion step, a diffusion model scores each position's own logits.
    diffusion: DiffusionStep | None = None
    # where the worker keeps its sliding-window layers in a pool of their own: their blocks for the
    # same positions, -1 for one that has left the window of every query of the chunk
    window_table: np.ndarray | None = None


@dataclass
class StepRequest:
    chunks: list[SeqChunk]
    finished: list[int] = field(default_factory=list)   # seq ids whose worker-side state may be dropped
    # (src, dst) KV blocks to copy, every layer, before the forward: a prompt sharing the first
    # tokens of a cached block continues in a copy of it
    copy_blocks: list[tuple[int, int]] = field(default_factory=list)
    copy_window_blocks: list[tuple[int, int]] = field(default_factory=list)   # in the windowed layers' pool
    # > 1: decode this many tokens in a row (every chunk one decode token that samples; each block
    # table covering start_pos + num_steps positions), each step's input the token sampled in the
    # one before; the scheduler drops what follows a sequence's stop (vLLM's multi-step scheduling)
    num_steps: int = 1


@dataclass
class SeqResult:
    seq_id: int
    token_id: int = -1             # -1 when the chunk did not sample
    logprob: float = 0.0
    top_ids: np.ndarray | None = None
    top_logprobs: np.ndarray | None = None
    score_ids: np.ndarray | None = None        # [len(chunk), k] when score_top_k > 0
    score_logprobs: np.ndarray | None = None
    score_target_logprobs: np.ndarray | None = None   # [len(chunk)], NaN where the target was -1
    # a chunk with drafts: the drafted tokens accepted, in order, before token_id (the correction
    # of the first rejected one, or the bonus token after all of them)
    accepted_ids: list[int] = field(default_factory=list)
    accepted_logprobs: list[float] = field(default_factory=list)
    # a diffusion chunk: canvas positions committed this step and their tokens, in commit order
    committed_positions: np.ndarray | None = None
    committed_ids: np.ndarray | None = None


@dataclass
class StepResult:
    results: list[SeqResult]
    tokens_computed: int = 0
    later: list[list[SeqResult]] = field(default_factory=list)   # steps 2.. of a multi-step request
