"""The engine's scheduling over random workloads, against a token-level stand-in for the worker.

The stand-in keeps a paged "KV pool" that stores token ids instead of K/V: each
step writes the chunk's tokens into the slots its block table names and
computes the next token from the context *read back through the block table*.
So a block shared by mistake, a prefix reused that does not match, or a
recompute that starts at the wrong position changes the output, which is
compared with the same prompt run alone on an empty engine. After every step
the reference counts must equal the number of block tables holding each block.
"""
from __future__ import annotations

from collections import Counter

import numpy as np
from hypothesis import given, settings, strategies as st

from scheduler.engine import Engine
from scheduler.sequence import Sequence
from shared.sampling_params import SamplingParams
from shared.step import SeqResult, StepRequest, StepResult

BLOCK = 4


class TokenKVWorker:
    def __init__(self, num_blocks: int):
        self.pool = np.full((num_blocks, BLOCK), -1, np.int64)
        self.tokens_computed = 0
        self.last_sampled: dict[int, int] = {}
        self.placeholders = 0

    def submit(self, request: StepRequest):
        """Pipelined use: runs the step at once, in order, as the worker would before any later
        one, and hands back a waiter (the engine folds the result one step later)."""
        result = self(request)
        return lambda: result

    def __call__(self, request: StepRequest) -> StepResult:
        out = []
        for seq_id in request.finished:
            self.last_sampled.pop(seq_id, None)
        for src, dst in request.copy_blocks:
            self.pool[dst] = self.pool[src]
        for c in request.chunks:
            if len(c.token_ids) == 1 and c.token_ids[0] == -1:
                c.token_ids = np.array([self.last_sampled[c.seq_id]])
                self.placeholders += 1
            table = np.asarray(c.block_table)
            pos = np.arange(c.start_pos, c.start_pos + len(c.token_ids))
            self.pool[table[pos // BLOCK], pos % BLOCK] = c.token_ids
            end = c.start_pos + len(c.token_ids)
            ctx = self.pool[table[np.arange(end) // BLOCK], np.arange(end) % BLOCK]
            if c.prefix_ids is not None:
                assert list(c.prefix_ids) == list(ctx[:c.start_pos])
            token = int((ctx * np.arange(1, end + 1)).sum() % 50 + 3) if c.sample else -1
            if c.sample:
                self.last_sampled[c.seq_id] = token
            out.append(SeqResult(c.seq_id, token_id=token))
            self.tokens_computed += len(c.token_ids)
        return StepResult(out, sum(len(c.token_ids) for c in request.chunks))


def run_alone(prompt: list[int], n: int, context: int, stops: tuple = ()) -> list[int]:
    engine = Engine(TokenKVWorker(64), 64, BLOCK, context, enable_prefix_caching=False)
    seq = Sequence(list(prompt), SamplingParams(max_tokens=n, temperature=0.0, stop_token_ids=stops))
    engine.add(seq)
    while engine.has_work():
        engine.step()
    return seq.output


def check_reference_counts(engine: Engine) -> None:
    holders = Counter(b for s in engine.running for b in s.block_table)
    for s in list(engine.waiting) + engine.preempted:
        assert s.block_table == []
    for block in engine.blocks.blocks:
        assert block.ref_count == holders.get(block.block_id, 0)
    assert engine.blocks.num_free == engine.blocks.num_blocks - len(holders)


prefixes = st.sampled_from([[], [1, 2, 3, 4], [1, 2, 3, 4, 5, 6, 7, 8, 9], [9] * 12, [1, 2, 3, 4, 9, 9, 9, 9]])
requests = st.lists(st.tuples(prefixes, st.lists(st.integers(1, 9), min_size=1, max_size=20),
                              st.integers(1, 12), st.integers(0, 12), st.booleans()),
                    min_size=1, max_size=10)


@settings(max_examples=250, deadline=None)
@given(requests=requests, num_blocks=st.integers(10, 40), budget=st.sampled_from([4, 8, 32]),
       max_seqs=st.sampled_from([1, 3, 16]), pipelined=st.booleans(), stop_token=st.sampled_from([None, 7, 11]),
       prefill_while_decoding=st.sampled_from([None, 1, 3]))
def test_random_workloads_keep_outputs_and_reference_counts(requests, num_blocks, budget, max_seqs, pipelined,
                                                            stop_token, prefill_while_decoding):
    """`pipelined`: decode steps are launched before the previous result is read (placeholder
    tokens); `stop_token` ends sequences on a sampled token, which a pipelined step cannot foresee."""
    context = num_blocks * BLOCK           # as a worker sizes it: one sequence always fits the pool
    worker = TokenKVWorker(num_blocks)
    engine = Engine(worker, num_blocks, BLOCK, context, max_num_batched_tokens=budget,
                    max_num_seqs=max_seqs, submit=worker.submit if pipelined else None,
                    max_prefill_tokens_while_decoding=prefill_while_decoding)
    stops = () if stop_token is None else (stop_token,)
    pending = sorted(((arrive, i) for i, (_, _, _, arrive, _) in enumerate(requests)), reverse=True)
    seqs: dict[int, Sequence] = {}
    aborted: set[int] = set()
    step = 0
    while pending or engine.has_work():
        while pending and pending[-1][0] <= step:
            _, i = pending.pop()
            prefix, suffix, n, _, _ = requests[i]
            seqs[i] = Sequence(prefix + suffix, SamplingParams(max_tokens=n, temperature=0.0, stop_token_ids=stops))
            engine.add(seqs[i])
        for i, (_, _, _, arrive, abort) in enumerate(requests):
            if abort and step == arrive + 2 and i in seqs and seqs[i].finish_reason is None:
                engine.abort(seqs[i].seq_id)
                aborted.add(i)
        engine.step()
        check_reference_counts(engine)
        step += 1
        assert step < 5000, "the engine stopped making progress"
    for i, (prefix, suffix, n, _, _) in enumerate(requests):
        if i in aborted:
            assert seqs[i].finish_reason == "abort"
        else:
            assert seqs[i].output == run_alone(prefix + suffix, n, context, stops), i
    assert engine.blocks.num_free == num_blocks


def test_a_step_that_decodes_takes_at_most_the_prefill_limit_of_prompt_tokens():
    """--max-prefill-tokens-while-decoding: a long prompt arriving while another request decodes
    is prefilled 8 tokens a step (the decode's inter-token latency stays one small step); alone,
    a prompt takes the whole budget of 32 per step. Outputs are unchanged."""
    steps: list[StepRequest] = []
    worker = TokenKVWorker(64)
    engine = Engine(lambda r: steps.append(r) or worker(r), 64, BLOCK, 256, max_num_batched_tokens=32,
                    max_prefill_tokens_while_decoding=8)
    first = Sequence([5, 6, 7], SamplingParams(max_tokens=30, temperature=0.0))
    engine.add(first)
    engine.step()
    assert [len(c.token_ids) for c in steps[-1].chunks] == [3]
    long_prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9] * 6
    second = Sequence(long_prompt, SamplingParams(max_tokens=4, temperature=0.0))
    engine.add(second)
    while engine.has_work():
        engine.step()
    prefill_sizes = [len(c.token_ids) for r in steps[1:] for c in r.chunks if c.seq_id == second.seq_id
                     and c.start_pos < len(long_prompt)]
    assert prefill_sizes == [8] * 6 + [6]              # 54 prompt tokens while `first` decodes
    assert all(sum(len(c.token_ids) for c in r.chunks) <= 9 for r in steps[1:])
    assert first.output == run_alone([5, 6, 7], 30, 256) and second.output == run_alone(long_prompt, 4, 256)

    alone = Sequence(long_prompt[::-1], SamplingParams(max_tokens=2, temperature=0.0))   # nothing cached
    engine.add(alone)
    engine.step()
    assert [len(c.token_ids) for c in steps[-1].chunks] == [32]


def test_identical_prompts_compute_their_shared_blocks_once():
    worker = TokenKVWorker(32)
    engine = Engine(worker, 32, BLOCK, 128)
    prompt = list(range(1, 20))                     # 4 full blocks + 3 tokens
    first = Sequence(list(prompt), SamplingParams(max_tokens=2, temperature=0.0))
    engine.add(first)
    while engine.has_work():
        engine.step()
    computed = worker.tokens_computed
    second = Sequence(list(prompt), SamplingParams(max_tokens=2, temperature=0.0))
    engine.add(second)
    while engine.has_work():
        engine.step()
    # 4 full blocks, and 2 tokens of the block the first sequence filled with its first output
    assert second.num_cached_tokens == 18 and second.output == first.output
    assert worker.tokens_computed - computed == (19 - 18) + 1    # the last prompt token, then one decode


def test_a_prompt_diverging_inside_a_block_continues_in_a_copy_of_it():
    worker = TokenKVWorker(32)
    steps = []
    engine = Engine(lambda req: steps.append(req) or worker(req), 32, BLOCK, 128)
    first = Sequence(list(range(1, 15)), SamplingParams(max_tokens=3, temperature=0.0))   # 3 blocks + 2
    engine.add(first)
    while engine.has_work():
        engine.step()
    block3 = worker.pool[first_table_block(steps, first.seq_id, 3)].copy()
    assert list(block3) == [13, 14] + first.output[:2]
    prompt = list(range(1, 14)) + [99, 98]          # shares 3 full blocks and token 13 of the 4th
    second = Sequence(list(prompt), SamplingParams(max_tokens=4, temperature=0.0))
    before = worker.tokens_computed
    engine.add(second)
    while engine.has_work():
        engine.step()
    copies = [c for req in steps for c in req.copy_blocks]
    assert len(copies) == 1 and copies[0][0] == first_table_block(steps, first.seq_id, 3)
    assert second.num_cached_tokens == 13
    assert worker.tokens_computed - before == (15 - 13) + 3
    assert second.output == run_alone(prompt, 4, 128)
    assert list(worker.pool[copies[0][0]]) == list(block3)     # the cached block itself is untouched
    assert engine.blocks.num_free == 32


def first_table_block(steps, seq_id: int, index: int) -> int:
    return next(int(c.block_table[index]) for req in steps for c in req.chunks
                if c.seq_id == seq_id and len(c.block_table) > index)


def test_pipelined_decode_launches_ahead_and_changes_nothing():
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8], [9] * 9]
    outputs = {}
    for pipelined in (False, True):
        worker = TokenKVWorker(32)
        engine = Engine(worker, 32, BLOCK, 128, submit=worker.submit if pipelined else None)
        seqs = [Sequence(list(p), SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=(13,)))
                for p in prompts]
        for s in seqs:
            engine.add(s)
        steps = 0
        while engine.has_work():
            engine.step()
            check_reference_counts(engine)
            steps += 1
        outputs[pipelined] = [s.output for s in seqs]
        assert engine.blocks.num_free == 32
        if pipelined:
            assert worker.placeholders > 10
        else:
            assert worker.placeholders == 0
    assert outputs[True] == outputs[False] == [run_alone(p, 12, 128, (13,)) for p in prompts]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 9), max_size=12), st.lists(st.integers(0, 9), max_size=12),
       st.integers(0, 30), st.integers(0, 30))
def test_token_slice_is_a_slice_of_prompt_and_output(prompt, output, start, stop):
    seq = Sequence(list(prompt), SamplingParams(max_tokens=50), output=list(output))
    assert seq.token_slice(start, stop) == (prompt + output)[start:stop]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 9), max_size=12), st.lists(st.integers(0, 9), max_size=12),
       st.one_of(st.none(), st.integers(-30, 30)), st.one_of(st.none(), st.integers(-30, 30)))
def test_a_token_view_slices_as_the_token_list(prompt, output, start, stop):
    seq = Sequence(list(prompt), SamplingParams(max_tokens=50), output=list(output))
    view = seq.token_view
    assert len(view) == len(prompt) + len(output)
    assert view[start:stop] == (prompt + output)[start:stop]
    seq.output.append(7)                       # a view follows the sequence it reads
    assert view[start:stop] == (prompt + output + [7])[start:stop]
