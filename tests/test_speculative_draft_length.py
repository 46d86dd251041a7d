"""The per-sequence draft length (scheduler/speculative/draft_length.py): +2 after a verification
that accepts every draft, -1 after one that does not, between 1 and --num-speculative-tokens;
then through the engine with the bundled model: a paragraph being copied drafts up to the
ceiling, an always-wrong proposer is cut down to one token a draft, and greedy output is the
plain one."""
from __future__ import annotations

import pytest

from scheduler.engine import Engine
from scheduler.sequence import Sequence
from scheduler.speculative import DraftLength, DraftRequest, NgramProposer, SpeculativeController, make_controller
from shared.sampling_params import SamplingParams


def test_lengths_grow_on_whole_acceptance_and_shrink_otherwise_within_bounds():
    lengths = DraftLength(7, start=5)
    assert lengths.of(1) == 5 and lengths.of(2) == 5
    lengths.verdict(1, drafted=5, accepted=5)
    assert lengths.of(1) == 7
    lengths.verdict(1, drafted=7, accepted=7)
    assert lengths.of(1) == 7                        # the ceiling
    lengths.verdict(1, drafted=7, accepted=3)
    assert lengths.of(1) == 6
    for _ in range(10):
        lengths.verdict(1, drafted=lengths.of(1), accepted=0)
    assert lengths.of(1) == 1                        # never below one token
    lengths.verdict(1, drafted=1, accepted=1)
    assert lengths.of(1) == 3
    assert lengths.of(2) == 5                        # sequences apart
    lengths.forget(1)
    assert lengths.of(1) == 5
    assert DraftLength(3, start=5).of(9) == 3        # starts at most at the ceiling
    with pytest.raises(ValueError):
        DraftLength(0)


def test_make_controller_schedules_lengths_up_to_num_speculative_tokens():
    spec = make_controller("ngram", 4)
    assert spec.lengths is not None and spec.lengths.ceiling == 4
    assert make_controller("ngram", 4, governor=False).lengths.ceiling == 4


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


class Recording(NgramProposer):
    """Prompt lookup, or a token that never comes while `wrong`; records each request's length."""

    def __init__(self, never: int):
        super().__init__(2, 4)
        self.never, self.wrong = never, False
        self.asked: list[int] = []

    def propose(self, requests: list[DraftRequest]) -> list[list[int]]:
        self.asked += [r.max_tokens for r in requests]
        if self.wrong:
            return [[self.never] * r.max_tokens for r in requests]
        return super().propose(requests)


PARAGRAPH = ("The lighthouse keeper climbed the spiral stairs every evening at dusk, carrying a small brass "
             "lamp and a notebook in which he wrote the color of the sea, the direction of the wind, and "
             "the names of the ships that passed the rocks below.")


def test_through_the_engine_copying_drafts_to_the_ceiling_and_wrong_drafts_shrink_to_one(engines):
    local = engines("smollm2-135m")
    runner = local.runner
    from router.tokenizer import Tokenizer
    tokenizer = Tokenizer.from_metadata(runner.gguf.metadata)
    cap = runner.capacity

    def run(spec, prompt: list[int], n: int) -> list[int]:
        eng = Engine(runner.execute, cap.num_blocks, cap.block_size, cap.max_context,
                     fingerprint=runner.config.fingerprint, enable_prefix_caching=False, speculative=spec)
        seq = Sequence(list(prompt), greedy(n))
        eng.add(seq)
        while eng.has_work():
            eng.step()
        return seq.output

    proposer = Recording(runner.config.vocab_size - 1)
    spec = SpeculativeController(proposer, 7, lengths=DraftLength(7, start=3))
    copy_prompt = tokenizer.encode(f"Repeat the paragraph exactly.\n\nParagraph: {PARAGRAPH}\n\n"
                                   f"Repeated: {PARAGRAPH[:40]}")
    assert run(spec, copy_prompt, 48) == run(None, copy_prompt, 48)
    assert proposer.asked[0] == 3 and max(proposer.asked) == 7, proposer.asked
    assert spec.stats.mean_acceptance_length > 4

    proposer.wrong, proposer.asked = True, []
    open_prompt = tokenizer.encode("Once upon a time, in a village by the sea, there lived an old")
    assert run(spec, open_prompt, 12) == run(None, open_prompt, 12)
    assert proposer.asked[:3] == [3, 2, 1] and set(proposer.asked[3:]) == {1}, proposer.asked
