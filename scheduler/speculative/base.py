"""The proposer interface: what drafts the tokens a target model then verifies in one pass.

A proposer is asked once per engine step, for every sequence that may draft in it, so one that
needs a forward pass of its own (a draft GGUF model on the worker, a model's MTP/NextN heads)
can batch them into one call; a proposer that keeps state per sequence (a draft model's KV
blocks) drops it in `forget`. N-gram lookup needs neither: it reads the tokens alone.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Sequence as TokenList


@dataclass(frozen=True)
class DraftRequest:
    seq_id: int
    # prompt + generated tokens so far, the last one the next input: the last `context_tokens` of
    # them where the proposer reads no more (a deep sequence's whole list costs the host a step)
    tokens: TokenList[int]
    max_tokens: int            # propose at most this many (>= 1)


class Proposer(ABC):
    name: str = ""
    # whether a proposal costs nothing worth counting (no forward pass): then the controller also
    # asks for one while the cost governor has paused drafting, to see when drafts would pay again
    cheap: bool = False
    # the trailing tokens of a sequence a proposal reads (None: all of them)
    context_tokens: int | None = None

    @abstractmethod
    def propose(self, requests: list[DraftRequest]) -> list[list[int]]:
        """Draft tokens per request, in order: each list may be shorter than its max_tokens, or
        empty (then that sequence decodes plainly this step)."""

    def forget(self, seq_id: int) -> None:
        """The sequence finished or was preempted: drop whatever is kept for it."""
