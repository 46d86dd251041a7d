"""Per-sequence backoff of drafting (scheduler/speculative/sequence_backoff.py): a sequence whose
drafts are all rejected skips drafting for 2, 4, 8, ... of its next tokens, an accepted draft
resets it, and a sequence backing off neither drafts nor holds the pipeline. Then through the
engine with the real model: always-wrong drafts are verified only a handful of times in 48
tokens, beside a copying sequence that keeps drafting, both with the plain greedy output."""
from __future__ import annotations

import pytest

from scheduler.engine import Engine
from scheduler.sequence import Sequence
from scheduler.speculative import DraftRequest, NgramProposer, Proposer, SequenceBackoff, SpeculativeController
from shared.sampling_params import SamplingParams


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def test_fruitless_verifications_double_the_skip_and_an_accepted_draft_resets_it():
    b = SequenceBackoff(first_skip=2, max_skip=8)
    seq = Sequence([1, 2, 3], greedy(100))
    assert b.allows(seq)
    resumes = []
    for _ in range(5):
        while not b.allows(seq):
            seq.output.append(7)
        resumes.append(len(seq.output))
        b.verdict(seq, accepted=0)
        seq.output.append(7)                 # the token the verification emits
        assert not b.allows(seq)
    # drafted at 0, then skipped 2, 4, 8, 8 tokens after each one-token verification
    assert resumes == [0, 3, 8, 17, 26]
    while not b.allows(seq):
        seq.output.append(7)
    b.verdict(seq, accepted=1)
    assert b.allows(seq) and b.backing_off() == 0
    b.verdict(seq, accepted=0)
    b.forget(seq.seq_id)
    assert b.allows(seq)
    with pytest.raises(ValueError):
        SequenceBackoff(first_skip=0)


def test_with_backoff_the_pipeline_is_held_once_a_quarter_of_the_batch_may_draft():
    spec = SpeculativeController(NgramProposer(1, 4), 4, backoff=SequenceBackoff())
    seqs = [Sequence([1, 2, 3], greedy(50)) for _ in range(8)]
    assert spec.holds_pipelining(seqs)
    for s in seqs[:7]:
        spec.backoff.verdict(s, accepted=0)
    assert not spec.holds_pipelining(seqs)          # 1 of 8 ready: launched ahead, no drafts
    spec.backoff.verdict(seqs[6], accepted=2)
    assert spec.holds_pipelining(seqs)              # 2 of 8
    assert spec.holds_pipelining(seqs[7:])          # one stream: itself
    assert SpeculativeController(NgramProposer(1, 4), 4).holds_pipelining(seqs[7:] + seqs[:6])   # no backoff


class WrongFor(Proposer):
    """Always-wrong drafts (the vocabulary's last token) for the sequences in `wrong`, prompt
    lookup for the others."""
    name = "wrong-for"

    def __init__(self, never: int, wrong: set[int]):
        self.never, self.wrong = never, wrong
        self.ngram = NgramProposer(1, 4)

    def propose(self, requests: list[DraftRequest]) -> list[list[int]]:
        looked_up = self.ngram.propose(requests)
        return [[self.never] * r.max_tokens if r.seq_id in self.wrong else d for r, d in zip(requests, looked_up)]


PARAGRAPH = ("The lighthouse keeper climbed the spiral stairs every evening at dusk, carrying a small brass "
             "lamp and a notebook in which he wrote the color of the sea, the direction of the wind, and "
             "the names of the ships that passed the rocks below.")


def test_through_the_engine_a_rejected_sequence_backs_off_while_a_copying_one_drafts_on(engines):
    local = engines("smollm2-135m")
    runner = local.runner
    from router.tokenizer import Tokenizer
    tokenizer = Tokenizer.from_metadata(runner.gguf.metadata)
    cap = runner.capacity

    def engine(spec=None) -> Engine:
        return Engine(runner.execute, cap.num_blocks, cap.block_size, cap.max_context,
                      fingerprint=runner.config.fingerprint, enable_prefix_caching=False, speculative=spec)

    open_prompt = tokenizer.encode("Once upon a time, in a village by the sea, there lived an old")
    copy_prompt = tokenizer.encode(f"Repeat the paragraph exactly.\n\nParagraph: {PARAGRAPH}\n\n"
                                   f"Repeated: {PARAGRAPH[:40]}")
    wrong, copying = Sequence(list(open_prompt), greedy(48)), Sequence(list(copy_prompt), greedy(48))
    proposer = WrongFor(runner.config.vocab_size - 1, {wrong.seq_id})
    spec = SpeculativeController(proposer, 4, backoff=SequenceBackoff())
    verified: dict[int, int] = {wrong.seq_id: 0, copying.seq_id: 0}
    settle = spec.settle

    def counting(seq, chunk, result):
        verified[seq.seq_id] += 1
        return settle(seq, chunk, result)
    spec.settle = counting
    eng = engine(spec)
    for s in (wrong, copying):
        eng.add(s)
    while eng.has_work():
        eng.step()
    plain = engine()
    expected = []
    for prompt in (open_prompt, copy_prompt):
        s = Sequence(list(prompt), greedy(48))
        plain.add(s)
        while plain.has_work():
            plain.step()
        expected.append(s.output)
    assert [wrong.output, copying.output] == expected
    # verified at outputs 1, 4, 9, 18, 35 at most (the first decode follows the prompt's token)
    assert 1 <= verified[wrong.seq_id] <= 5, verified
    assert spec.stats.accepted_tokens > 0
    # the copying sequence drafted at nearly every step: far fewer steps than its 48 tokens
    assert verified[copying.seq_id] >= 6 and verified[copying.seq_id] < 30, verified
