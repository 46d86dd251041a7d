"""Speculative decoding in process with the real models: n-gram drafts verified by the target
in the step's one forward must not change a greedy token, must keep the sampled distribution,
and must keep batching, preemption, abort, stop tokens and the prefix cache working."""
from __future__ import annotations

import numpy as np
import pytest

from conftest import load_fixture
from router.tokenizer import Tokenizer
from scheduler.engine import Engine
from scheduler.sequence import Sequence
from scheduler.speculative import DraftRequest, Proposer, SpeculativeController, make_controller
from shared.sampling_params import SamplingParams
from shared.step import SeqChunk
from test_sampling import CHI2_999

MODEL = "smollm2-135m"
PARAGRAPH = ("The lighthouse keeper climbed the spiral stairs every evening at dusk, carrying a small brass "
             "lamp and a notebook in which he wrote the color of the sea, the direction of the wind, and "
             "the names of the ships that passed the rocks below.")


def copy_prompt(tokenizer: Tokenizer) -> list[int]:
    text = f"Repeat the paragraph exactly.\n\nParagraph: {PARAGRAPH}\n\nRepeated: {PARAGRAPH[:40]}"
    return tokenizer.encode(text)


@pytest.fixture(scope="module")
def runner(engines):
    return engines(MODEL).runner


@pytest.fixture(scope="module")
def tokenizer(runner):
    return Tokenizer.from_metadata(runner.gguf.metadata)


def make_engine(runner, speculative: SpeculativeController | None = None, num_blocks: int | None = None,
                **kw) -> Engine:
    cap = runner.capacity
    return Engine(runner.execute, num_blocks or cap.num_blocks, cap.block_size, cap.max_context,
                  fingerprint=runner.config.fingerprint, speculative=speculative, **kw)


def greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, **kw)


def run(engine: Engine, seqs: list[Sequence]) -> list[list[int]]:
    for s in seqs:
        engine.add(s)
    while engine.has_work():
        engine.step()
    return [s.output for s in seqs]


def plain(runner, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    return run(make_engine(runner, enable_prefix_caching=False), [Sequence(list(p), params) for p in prompts])


@pytest.fixture(scope="module")
def prompts(tokenizer) -> list[list[int]]:
    """Every fixture prompt, a paragraph to copy and a function to repeat."""
    return [c["prompt_tokens"] for c in load_fixture(MODEL)["generate"]] + [
        copy_prompt(tokenizer), tokenizer.encode("def add(a, b):\n    return a + b\n\ndef add(a, b):\n")]


@pytest.fixture(scope="module")
def reference(runner, prompts, greedy_references) -> list[list[int]]:
    """Their plain greedy outputs, batched (batching changes no token: test_continuous_batching): the
    fixture prompts' from the session's references, the two added prompts' here."""
    fixture_outputs = greedy_references(MODEL, 24)
    return fixture_outputs + plain(runner, prompts[len(fixture_outputs):], greedy(24))


def test_greedy_output_with_ngram_drafts_is_the_plain_output_on_every_prompt(runner, prompts, reference):
    spec = make_controller("ngram", 4, governor=False)
    assert run(make_engine(runner, spec), [Sequence(list(p), greedy(24)) for p in prompts]) == reference
    assert spec.stats.drafts > 0 and spec.stats.accepted_tokens > 0


def test_greedy_output_with_ngram_drafts_is_the_plain_output_on_gemma3(engines, greedy_references):
    runner = engines("gemma3-270m").runner
    prompts = [c["prompt_tokens"] for c in load_fixture("gemma3-270m")["generate"]]
    spec = make_controller("ngram", 4, governor=False)
    assert run(make_engine(runner, spec), [Sequence(list(p), greedy(12)) for p in prompts]) == \
        greedy_references("gemma3-270m", 12)
    assert spec.stats.accepted_tokens > 0


def test_copying_accepts_most_drafts_stops_inside_them_and_commits_only_accepted_kv(runner, tokenizer, prompts,
                                                                                     reference):
    prompt, expected = prompts[-2], reference[-2]
    spec = make_controller("ngram", 5, governor=False)
    engine = make_engine(runner, spec)
    [got] = run(engine, [Sequence(list(prompt), greedy(24))])
    assert got == expected
    stats = spec.stats
    assert stats.accepted_tokens >= 0.6 * stats.draft_tokens, stats
    assert stats.mean_acceptance_length > 2.5, stats
    # a next turn sending back prompt + output reuses the blocks the speculative run committed: had
    # one held a rejected draft's K/V, its continuation would differ from a fresh prefill's
    turn = prompt + got + tokenizer.encode("\n\nAgain: ")
    hits = engine.blocks.hit_tokens
    [cached] = run(engine, [Sequence(list(turn), greedy(6))])
    assert engine.blocks.hit_tokens - hits >= (len(prompt) + len(got)) // 16 * 16 - 16
    assert cached == plain(runner, [turn], greedy(6))[0]
    # a stop token among accepted drafts ends the sequence there
    stop = expected[16]
    [stopped] = run(make_engine(runner, make_controller("ngram", 5, governor=False)),
                    [Sequence(list(prompt), greedy(24, stop_token_ids=(stop,)))])
    assert stopped == expected[:expected.index(stop) + 1]


def test_batched_decodes_with_and_without_drafts_preemption_and_abort(runner, prompts, reference):
    """Copy-heavy and open-ended prompts, some refusing speculation, in a pool small enough that
    sequences are preempted, one aborted mid-way: every other output is its plain one, and every
    block comes back."""
    chosen = [i for i, p in enumerate(prompts) if len(p) < 200]
    lengths = [24, 10, 18, 6, 22, 14, 20, 12][:len(chosen)]
    spec = make_controller("ngram", 4, governor=False)
    engine = make_engine(runner, spec, num_blocks=12, max_num_batched_tokens=48)
    seqs = [Sequence(list(prompts[i]), greedy(n)) for i, n in zip(chosen, lengths)]
    seqs[1].speculative = seqs[4].speculative = False
    doomed = Sequence(list(prompts[-2]), greedy(24))
    run_aborting(engine, seqs, doomed, at_step=4)
    for s, i, n in zip(seqs, chosen, lengths):
        assert s.output == reference[i][:n], i
    assert doomed.finish_reason == "abort"
    assert engine.num_preemptions > 0
    assert spec.stats.accepted_tokens > 0
    assert engine.blocks.num_free == engine.blocks.num_blocks
    assert all(b.ref_count == 0 for b in engine.blocks.blocks)


class FixedDraft(Proposer):
    """Always drafts the same token: forces verification where the target disagrees."""
    name = "fixed"

    def __init__(self, token: int):
        self.token = token

    def propose(self, requests: list[DraftRequest]) -> list[list[int]]:
        return [[self.token] * r.max_tokens for r in requests]


def run_aborting(engine, seqs: list, doomed, at_step: int) -> None:
    """Runs `doomed` and `seqs` to the end, aborting `doomed` after `at_step` engine steps."""
    for s in [doomed] + seqs:
        engine.add(s)
    steps = 0
    while engine.has_work():
        engine.step()
        steps += 1
        if steps == at_step:
            engine.abort(doomed.seq_id)


def top4_probs(runner, tokens: list[int]) -> dict[int, float]:
    """The model's next-token probabilities after `tokens` over its top 4 (temperature 1, top-k 4)."""
    chunk = SeqChunk(seq_id=-7, token_ids=np.asarray(tokens, np.int64), start_pos=0,
                     block_table=np.arange(-(-len(tokens) // runner.capacity.block_size), dtype=np.int32),
                     prompt_len=len(tokens), sample=False)
    row = runner.forward_logits([chunk])[-1].astype(np.float64)
    top = np.argsort(-row)[:4]
    w = np.exp(row[top] - row[top].max())
    return dict(zip(top.tolist(), (w / w.sum()).tolist()))


def test_sampled_tokens_after_a_forced_draft_keep_the_target_distribution(runner):
    """Rejection sampling: the second token of many seeded samples at temperature 1 (top-k 4),
    its first step carrying a forced draft, follows the model's own distribution (chi-square
    against the probabilities read from the model's logits)."""
    prompt = load_fixture(MODEL)["generate"][0]["prompt_tokens"]
    params = [SamplingParams(max_tokens=3, temperature=1.0, top_k=4, seed=s) for s in range(200)]
    first = top4_probs(runner, prompt)
    likely = max(first, key=first.get)
    after = top4_probs(runner, prompt + [likely])
    draft = sorted(after, key=after.get)[-2]           # the second choice: accepted about p of the time
    spec = SpeculativeController(FixedDraft(draft), 1)
    engine = make_engine(runner, spec, enable_prefix_caching=False)
    seqs = [Sequence(list(prompt), p) for p in params]
    run(engine, seqs)
    assert spec.stats.drafts == len(seqs)
    seconds = [s.output[1] for s in seqs if s.output[0] == likely]
    assert len(seconds) > 80
    ids = sorted(after)
    counts = np.array([seconds.count(t) for t in ids], np.float64)
    assert counts.sum() == len(seconds)               # nothing outside the model's top 4
    expected = np.array([after[t] for t in ids]) * len(seconds)
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < CHI2_999[len(ids) - 1], (chi2, counts, expected)
    assert 0 < spec.stats.accepted_tokens < len(seqs)
