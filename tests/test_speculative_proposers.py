"""The proposers of speculative decoding (scheduler/speculative/): n-gram prompt lookup, and the
registry that chooses one by name."""
from __future__ import annotations

import pytest

from scheduler.speculative import PROPOSERS, DraftRequest, NgramProposer, make_controller
from scheduler.speculative.ngram import find_continuation


def test_the_latest_earlier_occurrence_of_the_longest_tail_proposes_what_followed_it():
    assert find_continuation([1, 2, 3, 4, 1, 2, 3], 1, 4, 3) == [4, 1, 2]
    # [2, 3] occurs twice: the latest earlier one wins
    assert find_continuation([1, 2, 3, 9, 2, 3, 5, 2, 3], 1, 4, 2) == [5, 2]
    # a longer match beats a later, shorter one
    assert find_continuation([7, 2, 3, 8, 5, 3, 6, 7, 2, 3], 1, 4, 1) == [8]


def test_min_n_and_k_bound_the_proposal():
    assert find_continuation([1, 2, 3, 9, 7, 3, 5, 2, 3], 2, 4, 2) == [9, 7]
    assert find_continuation([1, 5, 6, 7, 8, 1], 2, 4, 3) == []       # only a 1-gram matches
    assert find_continuation([1, 5, 6, 7, 8, 1], 1, 4, 3) == [5, 6, 7]
    assert find_continuation([1, 2, 3], 1, 4, 2) == []
    assert find_continuation([5, 5, 5, 5], 1, 3, 2) == [5]           # overlapping repeats count
    assert find_continuation([1, 2, 1, 2], 1, 4, 0) == []


def test_proposers_are_chosen_by_name():
    assert PROPOSERS["ngram"] is NgramProposer
    assert make_controller("off") is None
    controller = make_controller("ngram", 5, 2, 3)
    assert controller.k == 5 and controller.method == "ngram"
    assert controller.governor is not None                       # the cost governor is on by default
    assert make_controller("ngram", governor=False).governor is None
    out = controller.proposer.propose([DraftRequest(0, [4, 5, 6, 4, 5], 2), DraftRequest(1, [1, 2], 3)])
    assert out == [[6, 4], []]
    draft = make_controller("draft", 4)      # the worker's draft model fills the placeholders
    assert draft.method == "draft" and draft.k == 4
    assert draft.proposer.propose([DraftRequest(0, [4, 5], 2), DraftRequest(1, [1], 3)]) == [[-1, -1], [-1, -1, -1]]
    with pytest.raises(ValueError, match="unknown speculative method"):
        make_controller("medusa")
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        NgramProposer(3, 2)
