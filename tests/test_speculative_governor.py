"""The cost governor of speculative decoding (scheduler/speculative/governor.py): fed measurements
directly with an injected clock, it pauses drafting where a token costs more with drafts than
without, probes again later with a doubling back-off, drafts again where drafting pays, keeps
each range of batch sizes apart, and a paused range schedules as speculation off does
(pipelining included). Then through the engine with the real model: drafts that never match
pause drafting, a copy-heavy text brings it back."""
from __future__ import annotations

import numpy as np
import pytest

from scheduler.engine import Engine
from scheduler.sequence import Sequence
from scheduler.speculative import CostGovernor, DraftRequest, NgramProposer, Proposer, SpeculativeController
from scheduler.speculative.governor import DRAFTING, PAUSED, PROBING, bucket_label, bucket_of
from shared.sampling_params import SamplingParams


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def governor(**kw) -> tuple[CostGovernor, Clock]:
    clock = Clock()
    kw = {"probe_steps": 4, "warmup_steps": 1, "backoff_steps": 10, "backoff_s": 1000.0, **kw}
    return CostGovernor(clock=clock, **kw), clock


def feed(g: CostGovernor, batch: int, steps: int, plain_s: float, draft_s: float, draft_tokens: int = 1) -> None:
    """`steps` steps in whatever mode the governor asks for: a plain step emits one token a
    sequence in plain_s, a drafting one draft_tokens a sequence in draft_s."""
    for _ in range(steps):
        if g.allows(batch):
            g.record(batch, True, batch * draft_tokens, draft_s)
        else:
            g.record(batch, False, batch, plain_s)


def test_buckets_of_batch_sizes():
    assert [bucket_label(i) for i in range(6)] == ["1", "2-3", "4-7", "8-15", "16-31", "32+"]
    assert [bucket_of(n) for n in (1, 2, 3, 4, 7, 8, 15, 16, 31, 32, 64)] == [0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5]


def test_probing_measures_plain_then_drafting_and_pauses_where_drafting_costs_more():
    g, _ = governor()
    assert g.state(1) == PROBING and not g.allows(1)            # plain first
    feed(g, 1, 5, plain_s=0.010, draft_s=0.016)                 # 1 warm-up + 4 plain samples
    assert g.state(1) == PROBING and g.allows(1)                # now drafting's turn
    feed(g, 1, 5, plain_s=0.010, draft_s=0.016)
    assert g.state(1) == PAUSED and not g.allows(1)
    [b] = [s for s in g.snapshot() if s.batch_sizes == "1"]
    assert b.pauses == 1 and not b.drafting
    assert b.plain_seconds_per_token == pytest.approx(0.010)
    assert b.draft_seconds_per_token == pytest.approx(0.016)
    # the other ranges were never used: still probing, nothing measured
    assert all(s.state == PROBING and s.plain_seconds_per_token == 0 for s in g.snapshot()[1:])


def test_drafting_that_pays_goes_on_and_a_far_worse_probe_ends_early():
    g, _ = governor()
    feed(g, 4, 10, plain_s=0.020, draft_s=0.040, draft_tokens=3)   # 0.0133 s a token against 0.02
    assert g.state(4) == DRAFTING and g.allows(7)
    g2, _ = governor(early_exit_steps=2)
    feed(g2, 32, 5, plain_s=0.05, draft_s=0.2)                     # plain phase
    feed(g2, 32, 3, plain_s=0.05, draft_s=0.2)                     # warm-up + 2 samples, 4x worse
    assert g2.state(32) == PAUSED


def test_paused_probes_again_after_backoff_steps_doubling_after_each_failure_and_drafts_when_it_pays():
    g, _ = governor()
    feed(g, 1, 10, plain_s=0.010, draft_s=0.012)               # 5 plain, 5 drafting (not worse enough to end early)
    assert g.state(1) == PAUSED
    feed(g, 1, 9, plain_s=0.010, draft_s=0.012)                # warm-up + 8 plain: not yet
    assert g.state(1) == PAUSED
    feed(g, 1, 2, plain_s=0.010, draft_s=0.012)
    assert g.state(1) == PROBING and g.allows(1)               # plain is fresh: drafting probed directly
    feed(g, 1, 5, plain_s=0.010, draft_s=0.012)                # fails again: back-off doubles
    assert g.state(1) == PAUSED and g.buckets[0].backoff_steps == 20 and g.buckets[0].probes == 1
    feed(g, 1, 20, plain_s=0.010, draft_s=0.012)
    assert g.state(1) == PAUSED
    feed(g, 1, 2, plain_s=0.010, draft_s=0.012)
    assert g.state(1) == PROBING
    feed(g, 1, 5, plain_s=0.010, draft_s=0.012, draft_tokens=4)   # the text turned copy-heavy
    assert g.state(1) == DRAFTING and g.buckets[0].backoff_steps == 10   # reset by a probe that paid


def test_paused_probes_again_after_backoff_seconds():
    g, clock = governor(backoff_steps=10**6, backoff_s=5.0)
    feed(g, 2, 10, plain_s=0.010, draft_s=0.016)
    assert g.state(2) == PAUSED
    feed(g, 2, 3, plain_s=0.010, draft_s=0.016)
    assert g.state(2) == PAUSED
    clock.now += 5.0
    feed(g, 2, 1, plain_s=0.010, draft_s=0.016)
    assert g.state(2) == PROBING and g.allows(3)


def test_drafting_pauses_when_its_ewma_turns_worse_and_rechecks_plain_periodically():
    g, _ = governor(margin=0.05, recheck_steps=1000, backoff_steps=100)
    feed(g, 1, 10, plain_s=0.010, draft_s=0.012, draft_tokens=3)
    assert g.state(1) == DRAFTING
    feed(g, 1, 30, plain_s=0.010, draft_s=0.012, draft_tokens=3)
    assert g.state(1) == DRAFTING
    feed(g, 1, 20, plain_s=0.010, draft_s=0.012, draft_tokens=1)   # a stretch the output does not copy
    assert g.state(1) == DRAFTING                                   # is not enough to pause
    feed(g, 1, 100, plain_s=0.010, draft_s=0.012, draft_tokens=1)  # the drafts stopped matching for good
    assert g.state(1) == PAUSED and g.buckets[0].pauses == 1
    g2, _ = governor(recheck_steps=20)
    feed(g2, 1, 10, plain_s=0.010, draft_s=0.012, draft_tokens=3)
    feed(g2, 1, 21, plain_s=0.010, draft_s=0.012, draft_tokens=3)
    assert g2.state(1) == PROBING and not g2.allows(1)             # measuring plain again first
    assert g2.buckets[0].probes == 1


def test_paused_probes_at_once_when_shadow_proposals_would_have_been_accepted():
    g, _ = governor(backoff_steps=1000, shadow_samples=8, shadow_wait=16, shadow_rate=0.5)
    feed(g, 1, 10, plain_s=0.010, draft_s=0.016)
    assert g.state(1) == PAUSED and g.buckets[0].shadow_wait == 32     # a probe that failed
    for _ in range(40):                                  # proposals the model does not produce
        g.shadow(1, False)
        feed(g, 1, 1, plain_s=0.010, draft_s=0.016)
    assert g.state(1) == PAUSED
    for _ in range(8):                                   # the text turned copyable
        g.shadow(1, True)
    assert g.state(1) == PROBING and g.allows(1) and g.buckets[0].probes == 1
    g.shadow(1, True)                                    # not paused: ignored
    feed(g, 1, 5, plain_s=0.010, draft_s=0.016)          # the probe fails: wait twice as long next time
    assert g.state(1) == PAUSED and g.buckets[0].shadow_wait == 64
    for _ in range(40):
        g.shadow(1, True)
        feed(g, 1, 1, plain_s=0.010, draft_s=0.016)
    assert g.state(1) == PAUSED                          # 39 paused steps counted (1 warm-up) < 64
    for _ in range(25):
        g.shadow(1, True)
        feed(g, 1, 1, plain_s=0.010, draft_s=0.016)
    assert g.state(1) == PROBING and g.buckets[0].probes == 2
    feed(g, 1, 5, plain_s=0.010, draft_s=0.016, draft_tokens=4)   # pays: the wait is reset
    assert g.state(1) == DRAFTING and g.buckets[0].shadow_wait == 16


def test_ranges_of_batch_sizes_are_governed_apart():
    g, _ = governor()
    feed(g, 1, 10, plain_s=0.010, draft_s=0.008, draft_tokens=2)
    feed(g, 32, 10, plain_s=0.040, draft_s=0.200, draft_tokens=2)
    assert g.state(1) == DRAFTING and g.state(40) == PAUSED and g.state(20) == PROBING


def test_measurements_of_the_other_mode_and_the_step_after_a_switch_do_not_count():
    g, _ = governor()
    g.record(1, False, 1, 0.010)                 # warm-up
    g.record(1, True, 1, 99.0)                   # a drafting step during plain's phase: a switch
    for _ in range(3):
        g.record(1, False, 1, 0.010)             # the first is warm-up again
    assert g.buckets[0].phase_samples == 2 and g.state(1) == PROBING
    g.record(1, False, 0, 0.010)                 # nothing emitted: ignored
    g.record(1, False, 1, 0.0)
    assert g.buckets[0].phase_samples == 2


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def test_a_paused_range_pipelines_and_asks_a_costly_proposer_nothing_a_cheap_one_one_token():
    class Counting(NgramProposer):
        calls: list[list[DraftRequest]] = []
        cheap = False

        def propose(self, requests):
            Counting.calls.append(requests)
            return super().propose(requests)

    class CheapCounting(Counting):
        cheap = True

    g, _ = governor()
    feed(g, 2, 10, plain_s=0.010, draft_s=0.030)
    assert g.state(2) == PAUSED
    spec = SpeculativeController(Counting(), 3, g)
    seqs = [Sequence([1, 2, 3, 1, 2], greedy(8)), Sequence([4, 5, 4, 5], greedy(8))]
    for s in seqs:
        s.num_computed = s.num_tokens - 1
    assert not spec.holds_pipelining(seqs)
    plan = [(s, 1) for s in seqs]
    assert spec.draft(plan, 100, 100, _Blocks(), 1000, batch_size=2) == (100, 100)
    assert plan == [(s, 1) for s in seqs] and Counting.calls == []
    cheap = SpeculativeController(CheapCounting(1, 4), 3, g)
    assert cheap.draft(plan, 100, 100, _Blocks(), 1000, batch_size=2) == (100, 100)
    assert plan == [(s, 1) for s in seqs]                   # nothing drafted: one shadow lookup
    [[request]] = Counting.calls
    assert request.max_tokens == 1
    shadowed = next(s for s in seqs if s.seq_id == request.seq_id)
    guess = NgramProposer(1, 4).propose([request])[0][0]
    shadowed.output.append(guess)                           # the model produced the guessed token
    cheap.draft(plan, 100, 100, _Blocks(), 1000, batch_size=2)
    assert g.buckets[1].shadow_count == 1 and g.buckets[1].shadow_hits == 1.0
    Counting.calls.clear()
    assert not spec.holds_pipelining(seqs[:1])   # batch size 1 is probing: plain steps first
    feed(g, 1, 10, plain_s=0.010, draft_s=0.008, draft_tokens=2)
    assert spec.holds_pipelining(seqs[:1])       # drafting pays there
    assert SpeculativeController(Counting(), 3).holds_pipelining(seqs)    # no governor: always drafts


def test_a_proposal_reads_only_the_tail_its_proposer_searches():
    """A deep sequence's whole token list is not built each step: n-gram lookup gets the last
    SEARCH_WINDOW tokens (and drafts what the whole context would give), a proposer that reads
    no tokens none, one that does not say all of them."""
    from scheduler.speculative.ngram import SEARCH_WINDOW, find_continuation

    class Recording(NgramProposer):
        def propose(self, requests):
            self.seen = [list(r.tokens) for r in requests]
            return super().propose(requests)

    class Blind(Recording):
        context_tokens = 0

    class Whole(Recording):
        context_tokens = None

    prompt = [int(t) for t in np.random.default_rng(3).integers(10, 5000, 3 * SEARCH_WINDOW)] + [7, 8, 9]
    seq = Sequence(prompt, greedy(8))
    seq.output.extend([4, 7, 8])                 # the tail 7 8 occurred before, followed by 9
    seq.num_computed = seq.num_tokens - 1
    for proposer, want in ((Recording(2, 4), seq.tokens[-SEARCH_WINDOW:]), (Blind(2, 4), []),
                           (Whole(2, 4), seq.tokens)):
        plan = [(seq, 1)]
        SpeculativeController(proposer, 3).draft(plan, 100, 100, _Blocks(), 100_000, batch_size=1)
        assert proposer.seen == [want]
        if want:                                 # the tail drafts what the whole list does
            assert seq.draft_tokens == find_continuation(seq.tokens, 2, 4, 3) and seq.draft_tokens[0] == 9
        seq.draft_tokens = []


class _Blocks:
    block_size = 16

    @staticmethod
    def blocks_needed(n: int) -> int:
        return -(-n // 16)


class Switchable(Proposer):
    """Drafts a token that never comes (the vocabulary's last, a rare merge) while `wrong`, prompt
    lookup otherwise."""
    name = "switchable"

    def __init__(self, never: int):
        self.wrong = True
        self.never = never
        self.ngram = NgramProposer(1, 4)

    def propose(self, requests: list[DraftRequest]) -> list[list[int]]:
        if self.wrong:
            return [[self.never] * r.max_tokens for r in requests]
        return self.ngram.propose(requests)


PARAGRAPH = ("The lighthouse keeper climbed the spiral stairs every evening at dusk, carrying a small brass "
             "lamp and a notebook in which he wrote the color of the sea, the direction of the wind, and "
             "the names of the ships that passed the rocks below.")


def test_through_the_engine_drafts_that_never_match_pause_drafting_and_copying_brings_it_back(engines):
    """Real steps of the bundled model, timed by the engine: drafts that are always wrong cost a
    verification pass for one token, so the governor pauses (and the engine then runs no proposer);
    a paragraph being copied, after the back-off, is drafted again. Greedy outputs stay the plain
    ones throughout."""
    local = engines("smollm2-135m")
    runner = local.runner
    from router.tokenizer import Tokenizer
    tokenizer = Tokenizer.from_metadata(runner.gguf.metadata)
    cap = runner.capacity
    proposer = Switchable(runner.config.vocab_size - 1)
    g = CostGovernor(probe_steps=4, warmup_steps=1, backoff_steps=8, backoff_s=1000.0)
    spec = SpeculativeController(proposer, 4, g)
    engine = Engine(runner.execute, cap.num_blocks, cap.block_size, cap.max_context,
                    fingerprint=runner.config.fingerprint, enable_prefix_caching=False, speculative=spec)
    plain_engine = Engine(runner.execute, cap.num_blocks, cap.block_size, cap.max_context,
                          fingerprint=runner.config.fingerprint, enable_prefix_caching=False)

    def run(eng: Engine, prompt: list[int], n: int, watch=None) -> list[int]:
        seq = Sequence(list(prompt), greedy(n))
        eng.add(seq)
        while eng.has_work():
            eng.step()
            if watch is not None:
                watch()
        return seq.output

    states = []
    open_prompt = tokenizer.encode("Once upon a time, in a village by the sea, there lived an old")
    out = run(engine, open_prompt, 24, lambda: states.append(g.state(1)))
    assert out == run(plain_engine, open_prompt, 24)
    assert PAUSED in states, states
    paused_at = states.index(PAUSED)
    assert spec.stats.accepted_tokens == 0 and spec.stats.drafts > 0
    assert all(s == PAUSED for s in states[paused_at:paused_at + 6])

    proposer.wrong = False
    copy_prompt = tokenizer.encode(f"Repeat the paragraph exactly.\n\nParagraph: {PARAGRAPH}\n\n"
                                   f"Repeated: {PARAGRAPH[:40]}")
    states.clear()
    out = run(engine, copy_prompt, 64, lambda: states.append(g.state(1)))
    assert out == run(plain_engine, copy_prompt, 64)
    # drafting again once the back-off let it probe (and perhaps paused again at the end, where the
    # model stops copying: the paragraph is repeated by then)
    assert DRAFTING in states[states.index(PROBING):], states
    assert spec.stats.accepted_tokens > 0
    assert g.buckets[0].probes >= 1
