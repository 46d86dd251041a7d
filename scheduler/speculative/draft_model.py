"""The draft-model proposer (`--speculative draft`): a draft GGUF run by the worker beside the
target (`--draft-model` on the worker, worker/draft_model.py).

The scheduler keeps its role (who drafts how many tokens: the controller's rules, as for n-gram
drafts); the drafting itself happens on the worker, in the same step as the verification, so a
speculative step stays one round trip. This proposer therefore answers with placeholders: the
chunk goes out as [last, -1 x k] with num_draft = k, the worker fills the k positions with the
draft model's greedy tokens, verifies them in the step's forward and answers with the accepted
ones and its own token after them, exactly as for drafts the scheduler wrote. Draft heads that a
model carries inside its GGUF (MTP / NextN) fit the same contract: another worker-side drafter
behind the same placeholders.
"""
from __future__ import annotations

from scheduler.speculative.base import DraftRequest, Proposer

PLACEHOLDER = -1        # a drafted position the worker fills in


class DraftModelProposer(Proposer):
    name = "draft"
    worker_side = True      # the tokens come from the worker; the scheduler only sizes the drafts
    context_tokens = 0

    def propose(self, requests: list[DraftRequest]) -> list[list[int]]:
        return [[PLACEHOLDER] * r.max_tokens for r in requests]
