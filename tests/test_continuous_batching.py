"""Iteration-level scheduling and prefix sharing with the real SmolLM2 model in process.

Every comparison is against the same prompt run alone, greedy, on an engine
with the prefix cache off: batching, chunked prefill, preemption and prefix
reuse must not change a single token.
"""
from __future__ import annotations

import random

import numpy as np
import pytest

from conftest import load_fixture
from scheduler.engine import Engine
from scheduler.sequence import Sequence
from shared.sampling_params import SamplingParams

MODEL = "smollm2-135m"


@pytest.fixture(scope="module")
def runner(engines):
    return engines(MODEL).runner


def make_engine(runner, num_blocks: int | None = None, **kw) -> Engine:
    cap = runner.capacity
    return Engine(runner.execute, num_blocks or cap.num_blocks, cap.block_size, cap.max_context,
                  fingerprint=runner.config.fingerprint, **kw)


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def alone(runner, prompt: list[int], n: int) -> list[int]:
    engine = make_engine(runner, enable_prefix_caching=False)
    seq = Sequence(list(prompt), greedy(n))
    engine.add(seq)
    while engine.has_work():
        engine.step()
    return seq.output


def sixteen_requests() -> list[tuple[list[int], int]]:
    fx = load_fixture(MODEL)
    prompts = [c["prompt_tokens"] for c in fx["generate"] if len(c["prompt_tokens"]) < 200]
    prompts += [t["tokens_add_special"] for t in fx["tokenize"] if len(t["tokens_add_special"]) >= 5]
    rng = random.Random(4)
    chosen = prompts[:16]
    assert len(chosen) == 16 and len({len(p) for p in chosen}) >= 10
    return [(p, rng.randint(4, 20)) for p in chosen]


def run_with_arrivals(engine: Engine, requests, seed: int = 0):
    """Requests join at random steps while others are running; returns the sequences and the
    largest batch seen."""
    rng = random.Random(seed)
    arrivals = sorted((rng.randint(0, 25), i) for i in range(len(requests)))
    seqs = [Sequence(list(p), greedy(n)) for p, n in requests]
    step = widest = 0
    while arrivals or engine.has_work():
        while arrivals and arrivals[0][0] <= step:
            engine.add(seqs[arrivals.pop(0)[1]])
        engine.step()
        widest = max(widest, len(engine.running))
        step += 1
    return seqs, widest


def assert_no_block_held(engine: Engine) -> None:
    assert engine.blocks.num_free == engine.blocks.num_blocks
    assert all(b.ref_count == 0 for b in engine.blocks.blocks)


def test_sixteen_requests_arriving_at_random_moments_get_their_solo_tokens(runner):
    requests = sixteen_requests()
    solo = [alone(runner, p, n) for p, n in requests]
    engine = make_engine(runner, max_num_batched_tokens=48)      # prompts prefill in chunks beside decodes
    seqs, widest = run_with_arrivals(engine, requests)
    assert widest >= 8
    assert [s.output for s in seqs] == solo
    assert engine.num_preemptions == 0
    assert_no_block_held(engine)


def test_a_pool_too_small_preempts_and_outputs_do_not_change(runner):
    requests = sixteen_requests()
    solo = [alone(runner, p, n) for p, n in requests]
    longest = max(len(p) + n for p, n in requests)
    num_blocks = -(-longest // runner.capacity.block_size) + 4    # one long sequence fits, sixteen do not
    engine = make_engine(runner, num_blocks=num_blocks, max_num_batched_tokens=48)
    seqs, _ = run_with_arrivals(engine, requests, seed=1)
    assert engine.num_preemptions > 0
    assert any(s.num_preemptions for s in seqs)
    assert [s.output for s in seqs] == solo
    assert_no_block_held(engine)


def test_a_shared_1000_token_prefix_is_computed_once(runner):
    text = next(c["prompt_tokens"] for c in load_fixture(MODEL)["generate"] if len(c["prompt_tokens"]) > 1000)
    prefix = text[:1000]
    first, second = prefix + text[1000:1010], prefix + text[1050:1063]
    engine = make_engine(runner)
    bs = engine.blocks.block_size

    def computed_by_worker(prompt: list[int]) -> tuple[int, Sequence]:
        before = runner.tokens_computed
        seq = Sequence(list(prompt), greedy(1))
        engine.add(seq)
        while engine.has_work():
            engine.step()
        return runner.tokens_computed - before, seq

    n1, s1 = computed_by_worker(first)
    n2, s2 = computed_by_worker(second)
    common = next(i for i, (a, b) in enumerate(zip(first, second)) if a != b)   # 1000, or more by chance
    # the full blocks of the shared prefix, then the first tokens of the block where the prompts part
    # (continued in a copy of the first prompt's block)
    reusable = (common // bs) * bs + min(common % bs, bs - 1)
    assert common >= 1000 and reusable == common
    assert n1 == len(first) and s1.num_cached_tokens == 0
    assert s2.num_cached_tokens == reusable
    assert n2 == len(second) - reusable                           # only the suffix
    assert engine.blocks.hit_tokens == reusable and engine.blocks.queried_tokens == len(first) + len(second)
    assert s2.output == alone(runner, second, 1)
    # a prompt that is entirely cached still computes its last token, for its logits
    n3, s3 = computed_by_worker(second)
    assert s3.num_cached_tokens == ((len(second) - 1) // bs) * bs and n3 == len(second) - s3.num_cached_tokens
    assert s3.output == s2.output


def test_reuse_extends_into_generated_tokens(runner):
    """A follow-up prompt that repeats an earlier prompt and its answer (a multi-turn chat) reuses
    the blocks the answer's tokens filled during decoding."""
    text = next(c["prompt_tokens"] for c in load_fixture(MODEL)["generate"] if len(c["prompt_tokens"]) > 1000)
    engine = make_engine(runner)
    turn1 = Sequence(list(text[:40]), greedy(40))
    engine.add(turn1)
    while engine.has_work():
        engine.step()
    turn2 = Sequence(turn1.prompt + turn1.output + text[40:45], greedy(3))
    engine.add(turn2)
    while engine.has_work():
        engine.step()
    assert turn2.num_cached_tokens == (79 // 16) * 16 > len(turn1.prompt)
    assert turn2.output == alone(runner, turn2.prompt, 3)


def test_abort_at_any_point_releases_every_block(runner):
    fx = load_fixture(MODEL)
    long_prompt = next(c["prompt_tokens"] for c in fx["generate"] if len(c["prompt_tokens"]) > 1000)[:600]
    short = fx["generate"][1]["prompt_tokens"]
    engine = make_engine(runner, max_num_batched_tokens=128)
    waiting = Sequence(list(short) + [5], greedy(50))
    prefilling = Sequence(list(long_prompt), greedy(50))
    decoding = Sequence(list(short), greedy(50))
    keeps = Sequence(list(short) + [7, 8], greedy(8))
    for s in (decoding, keeps, prefilling):
        engine.add(s)
    engine.step()
    engine.step()
    engine.add(waiting)
    assert decoding.output and prefilling.num_computed < len(prefilling.prompt) and waiting in engine.waiting
    for s in (prefilling, decoding, waiting):
        engine.abort(s.seq_id)
        assert s.finish_reason == "abort" and s.block_table == []
    held = sum(len(s.block_table) for s in engine.running)
    assert engine.running == [keeps] and engine.blocks.num_free == engine.blocks.num_blocks - held
    while engine.has_work():
        engine.step()
    assert keeps.output == alone(runner, keeps.prompt, 8)
    assert_no_block_held(engine)


def test_first_come_first_served_nobody_starves(runner):
    """With room for one sequence at a time, requests finish in arrival order: a later, shorter
    request never overtakes one that arrived before it."""
    fx = load_fixture(MODEL)
    prompts = [c["prompt_tokens"] for c in fx["generate"] if len(c["prompt_tokens"]) < 60]
    engine = make_engine(runner, max_num_seqs=1)
    seqs = [Sequence(list(p), greedy(3 + i)) for i, p in enumerate(prompts)]
    for s in seqs:
        engine.add(s)
    order = []
    while engine.has_work():
        for s in engine.step():
            if s.finish_reason:
                order.append(s)
    assert order == seqs


def test_a_long_prompt_is_prefilled_in_chunks_beside_the_running_decodes(runner):
    """Every step while a long prompt prefills still carries each running decode, and no step
    exceeds the token budget (loadtest/bench_chunked_prefill.py measures what this does to latency)."""
    fx = load_fixture(MODEL)
    long_prompt = next(c["prompt_tokens"] for c in fx["generate"] if len(c["prompt_tokens"]) > 1000)[:600]
    steps = []

    def recording(request):
        steps.append([(c.seq_id, len(c.token_ids)) for c in request.chunks])
        return runner.execute(request)
    cap = runner.capacity
    engine = Engine(recording, cap.num_blocks, cap.block_size, cap.max_context, max_num_batched_tokens=128,
                    fingerprint=runner.config.fingerprint)
    streams = [Sequence(list(c["prompt_tokens"]), greedy(60)) for c in fx["generate"][:4]]
    for s in streams:
        engine.add(s)
    while any(not s.output for s in streams):
        engine.step()
    long_seq = Sequence(list(long_prompt), greedy(1))
    engine.add(long_seq)
    first = len(steps)
    while not long_seq.output:
        engine.step()
    prefill_steps = steps[first:]
    ids = {s.seq_id for s in streams}
    assert len(prefill_steps) == -(-600 // (128 - 4))            # chunks of what the decodes leave
    for step in prefill_steps:
        assert sum(n for _, n in step) <= 128
        assert {sid for sid, n in step if n == 1} >= ids           # every stream decoded in every step
        assert any(sid == long_seq.seq_id and n > 1 for sid, n in step)
    for s in streams:
        engine.abort(s.seq_id)


def test_prompt_logprobs_are_exact_for_unlikely_tokens(runner):
    """Each prompt token's own logprob comes back even when it is far outside the top k (echo)."""
    import numpy as np
    from scheduler.events import fill_prompt_logprobs
    from protos.tensorserve.v1 import scheduler_pb2
    from shared.step import SeqChunk

    prompt = [1, 30001, 777, 45000, 12, 9999, 3, 40000]           # arbitrary ids: most are unlikely
    engine = make_engine(runner, max_num_batched_tokens=3)          # scored across several chunks
    seq = Sequence(list(prompt), greedy(1), score_top_k=1)
    engine.add(seq)
    while engine.has_work():
        engine.step()
    ev = scheduler_pb2.SubmitEvent()
    fill_prompt_logprobs(ev, seq, 0)
    got = [t.logprob for t in ev.prompt_logprobs]
    logits = runner.forward_logits([SeqChunk(seq_id=-7, token_ids=np.array(prompt), start_pos=0,
                                             block_table=np.arange(1), prompt_len=len(prompt), sample=False,
                                             score_top_k=1)]).astype(np.float64)
    logp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
        - logits.max(-1, keepdims=True)
    want = [logp[i, prompt[i + 1]] for i in range(len(prompt) - 1)]
    assert all(np.isfinite(got)) and min(want) < -8                 # really outside any small top-k
    np.testing.assert_allclose(got, want, atol=2e-3)


def test_several_decode_steps_a_call_change_no_token(runner):
    """num_decode_steps=4 (multi-step scheduling): the sixteen requests arriving at random moments
    still get their solo tokens; steps that only decode ran 4 tokens a call where every sequence
    had 4 to go, fewer before a max_tokens, one while a prompt waited or prefilled."""
    requests = sixteen_requests()
    solo = [alone(runner, p, n) for p, n in requests]
    calls = []

    def execute(request):
        calls.append(request.num_steps)
        return runner.execute(request)

    cap = runner.capacity
    engine = Engine(execute, cap.num_blocks, cap.block_size, cap.max_context, fingerprint=runner.config.fingerprint,
                    max_num_batched_tokens=48, num_decode_steps=4)
    seqs, _ = run_with_arrivals(engine, requests)
    assert [s.output for s in seqs] == solo
    assert calls.count(4) >= 3 and 1 in calls and max(calls) == 4
    assert_no_block_held(engine)


def test_several_decode_steps_stop_where_one_step_stops_and_sample_alike(runner):
    """A stop token met inside a 4-step call ends the output there (the tokens after it are
    dropped, its blocks freed); seeded sampling with penalties and logprobs (the worker's
    step-by-step path) gives the same tokens and logprobs as one step a call; a prompt that
    continues the stopped sequence reuses its committed blocks and still gets its solo tokens."""
    prompt = sixteen_requests()[0][0]
    free_run = alone(runner, prompt, 12)
    stop_at = next(i for i in range(5, 12) if free_run[i] not in free_run[:i])  # first occurrence: it stops there
    params = [SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=(free_run[stop_at],)),
              SamplingParams(max_tokens=11, temperature=0.9, top_p=0.9, seed=3, logprobs=3, ignore_eos=True,
                             frequency_penalty=0.5)]
    outputs = {}
    for steps in (1, 4):
        engine = make_engine(runner, num_decode_steps=steps)
        seqs = [Sequence(list(prompt), p) for p in params]
        for s in seqs:
            engine.add(s)
        while engine.has_work():
            engine.step()
        outputs[steps] = [(s.output, [None if np.isnan(x) else x for x in s.logprobs], s.finish_reason)
                          for s in seqs]            # greedy rows without logprobs carry NaN
        assert_no_block_held(engine)
    assert outputs[4] == outputs[1]
    assert outputs[4][0] == (free_run[:stop_at + 1], outputs[4][0][1], "stop")
    assert len(outputs[4][1][0]) == 11 and all(x is not None and x < 0 for x in outputs[4][1][1])

    engine = make_engine(runner, num_decode_steps=4)
    first = Sequence(list(prompt), greedy(40))
    engine.add(first)
    while engine.has_work():
        engine.step()
    follow = Sequence(list(prompt) + first.output[:33], greedy(8))
    engine.add(follow)
    while engine.has_work():
        engine.step()
    assert follow.num_cached_tokens >= (len(follow.prompt) - 1) // 16 * 16 >= 32   # blocks filled 4 tokens a call
    assert follow.output == alone(runner, follow.prompt, 8)


def test_a_replayed_call_that_ends_early_is_finished_step_by_step(runner, monkeypatch):
    """When the one-call path of a 4-step request stops after 2 steps (what a row with NaN logits
    does: -1 from that step on), the worker computes the other steps one at a time: same tokens."""
    prompt = sixteen_requests()[1][0]
    solo = alone(runner, prompt, 13)
    ended_early = []
    whole = runner.ops.run_greedy_steps

    def two_then_stop(model, inp, steps):
        tokens = whole(model, inp, min(steps, 2))
        if tokens is None or steps <= 2:
            return tokens
        ended_early.append(steps)
        return np.vstack([tokens, np.full((steps - 2, tokens.shape[1]), -1, np.int64)])

    monkeypatch.setattr(runner.ops, "run_greedy_steps", two_then_stop)
    engine = make_engine(runner, num_decode_steps=4)
    seq = Sequence(list(prompt), greedy(13))
    engine.add(seq)
    while engine.has_work():
        engine.step()
    assert ended_early == [4, 4, 4] and seq.output == solo
    assert_no_block_held(engine)
