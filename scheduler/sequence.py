"""A request's life in the scheduler: prompt, generated tokens, KV block table, status."""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from enum import Enum

from scheduler.block_table import BlockTable
from shared.sampling_params import SamplingParams

_ids = itertools.count()
_arrivals = itertools.count()


class TokenView:
    """A sequence's tokens for slicing, without building the whole list: what the prefix cache
    reads of a long context every block (a block's tokens), at a cost that does not grow with it."""

    __slots__ = ("seq",)

    def __init__(self, seq: "Sequence") -> None:
        self.seq = seq

    def __len__(self) -> int:
        return self.seq.num_tokens

    def __getitem__(self, span: slice) -> list[int]:
        start, stop, step = span.indices(self.seq.num_tokens)
        if step != 1:
            raise ValueError("a token view takes contiguous slices")
        return self.seq.token_slice(start, stop)


class Status(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


@dataclass(eq=False)   # identity: a sequence is itself, whatever its fields hold
class Sequence:
    prompt: list[int]
    params: SamplingParams
    eos_ids: frozenset[int] = frozenset()
    score_top_k: int = 0                      # > 0: also return top-k logprobs of every prompt position
    # with score_top_k: False = scoring only (finishes "scored" once the prompt is computed);
    # True = score the prompt positions, then generate as usual (echo with logprobs)
    generate_after_score: bool = False
    seq_id: int = field(default_factory=lambda: next(_ids))
    output: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[tuple] = field(default_factory=list)
    prompt_scores: list[tuple] = field(default_factory=list)
    arrival: int = field(default_factory=lambda: next(_arrivals))   # first-come-first-served order
    block_table: BlockTable = field(default_factory=BlockTable)
    # the sliding-window layers' own pool (scheduler/window_blocks.py), where the worker has one:
    # entry for entry beside block_table, -1 before window_start (released: out of every window)
    window_table: BlockTable = field(default_factory=BlockTable)
    window_start: int = 0
    num_computed: int = 0                      # tokens whose K/V is in the cache
    block_hashes: list[bytes] = field(default_factory=list)   # prefix-cache hashes of its full blocks
    num_committed_blocks: int = 0              # leading blocks registered in the prefix cache
    num_saved_blocks: int = 0                  # leading prompt blocks handed to the prefix checkpoints
    stores_checked: bool = False               # its prefix was looked up in the checkpoint stores (this admission)
    num_cached_tokens: int = -1                # prompt tokens taken from the prefix cache (first admission)
    send_prefix: bool = False                  # next chunk carries tokens [0, start): the worker may not have them
    status: Status = Status.WAITING
    num_preemptions: int = 0                   # times its KV was dropped to be recomputed
    finish_reason: str | None = None
    speculative: bool = True                   # False: the request asked for no speculative decoding
    draft_tokens: list[int] = field(default_factory=list)   # drafted for the step in flight, to verify

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    @property
    def token_view(self) -> TokenView:
        return TokenView(self)

    def token_slice(self, start: int, stop: int) -> list[int]:
        """tokens[start:stop] without building the whole list (a step's chunk of a long context)."""
        n = len(self.prompt)
        if stop <= n:
            return self.prompt[start:stop]
        if start >= n:
            return self.output[start - n:stop - n]
        return self.prompt[start:] + self.output[:stop - n]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.output)

    def append(self, token: int) -> None:
        self.output.append(token)
        p = self.params
        if token in p.stop_token_ids or (token in self.eos_ids and not p.ignore_eos):
            self.finish_reason = "stop"
        elif len(self.output) >= p.max_tokens:
            self.finish_reason = "length"
