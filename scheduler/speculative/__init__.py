"""Speculative decoding under the scheduler's control: proposers draft tokens (one interface,
chosen by name in PROPOSERS), the worker verifies them in the step's one forward, and the
controller (controller.py) decides who drafts how many and folds the verdicts back."""
from __future__ import annotations

from scheduler.speculative.base import DraftRequest, Proposer
from scheduler.speculative.controller import SpeculativeController, SpeculativeStats
from scheduler.speculative.draft_length import DraftLength
from scheduler.speculative.draft_model import DraftModelProposer
from scheduler.speculative.governor import BucketState, CostGovernor
from scheduler.speculative.ngram import NgramProposer
from scheduler.speculative.sequence_backoff import SequenceBackoff

# `--speculative NAME`; "draft" asks the worker's draft model (--draft-model) for the tokens
PROPOSERS: dict[str, type[Proposer]] = {"ngram": NgramProposer, "draft": DraftModelProposer}
METHODS = ("off", "ngram", "draft")


def make_controller(method: str, num_speculative_tokens: int = 5, prompt_lookup_min: int = 2,
                    prompt_lookup_max: int = 4, governor: bool = True) -> SpeculativeController | None:
    """The engine's controller for `--speculative METHOD`, or None for "off"; with a cost governor
    and per-sequence backoff (`--speculative-governor`, on by default) unless `governor` is False."""
    if method == "off":
        return None
    if method == "draft":
        proposer: Proposer = DraftModelProposer()
    elif method == "ngram":
        proposer = NgramProposer(prompt_lookup_min, prompt_lookup_max)
    else:
        raise ValueError(f"unknown speculative method {method!r}: one of {', '.join(METHODS)}")
    lengths = DraftLength(num_speculative_tokens)
    if not governor:
        return SpeculativeController(proposer, num_speculative_tokens, lengths=lengths)
    return SpeculativeController(proposer, num_speculative_tokens, CostGovernor(), SequenceBackoff(), lengths)


__all__ = ["DraftRequest", "Proposer", "NgramProposer", "DraftModelProposer", "PROPOSERS", "METHODS",
           "SpeculativeController", "SpeculativeStats", "CostGovernor", "BucketState", "SequenceBackoff", "DraftLength",
           "make_controller"]
