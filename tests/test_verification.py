"""Verifying drafted tokens on the worker (worker/verification.py): greedy keeps the argmax path,
rejection sampling keeps each row's distribution exactly (one-hot drafts), and the contract
carries drafts and verdicts across the wire."""
from __future__ import annotations

import numpy as np
import pytest

from shared.sampling_params import SamplingParams
from shared.step import SeqChunk, SeqResult, StepRequest, StepResult
from shared.step_codec import (step_request_from_proto, step_request_to_proto, step_result_from_proto,
                               step_result_to_proto)
from test_sampling import assert_matches, softmax
from worker.sampling import apply_penalties, make_generator
from worker.verification import verify_drafts

ROWS = np.array([[2.0, 1.0, 0.5, 0.0, -0.5, 1.5],
                 [0.0, 3.0, 1.0, 0.5, 0.2, 0.1],
                 [1.0, 1.0, 2.0, 0.0, 0.0, 0.0]], np.float32)


def test_greedy_accepts_while_the_draft_is_the_argmax_then_emits_the_argmax():
    p = SamplingParams(temperature=0.0)
    gen = make_generator(0)
    assert verify_drafts(ROWS, [0, 1], p, [], [], gen) == ([0, 1], 2)      # all accepted, then the bonus
    assert verify_drafts(ROWS, [0, 4], p, [], [], gen) == ([0], 1)         # rejected at row 1
    assert verify_drafts(ROWS, [5, 1], p, [], [], gen) == ([], 0)
    # penalties see the drafts accepted before each row: token 1 repeated is penalised at row 2
    pen = SamplingParams(temperature=0.0, repetition_penalty=10.0)
    assert verify_drafts(ROWS[[1, 1]], [1], pen, [], [], gen) == ([1], 2)


@pytest.mark.parametrize("params,draft", [(SamplingParams(temperature=1.0), 0),
                                          (SamplingParams(temperature=0.7, top_k=4), 3),
                                          (SamplingParams(temperature=1.0, top_p=0.8), 5),
                                          (SamplingParams(temperature=1.0, presence_penalty=1.5), 5)])
def test_the_first_token_after_a_draft_follows_the_row_distribution(params, draft):
    gen = make_generator(11)
    history = [5, 5]
    firsts = np.array([(lambda a, t: a[0] if a else t)(*verify_drafts(ROWS[:2], [draft], params, [], history, gen))
                       for _ in range(20000)])
    row = apply_penalties(ROWS[0], params, [], history) / np.float32(params.temperature)
    expected = softmax(row)
    if params.top_k:
        expected[np.argsort(-row)[params.top_k:]] = 0
    if params.top_p < 1:
        order = np.argsort(-expected)
        mass = np.cumsum(expected[order]) - expected[order]
        expected[order[mass >= params.top_p]] = 0
    assert_matches(firsts, expected / expected.sum())


def test_the_contract_carries_drafts_and_verdicts():
    chunk = SeqChunk(seq_id=3, token_ids=np.array([7, 8, 9], np.int64), start_pos=10,
                     block_table=np.array([0, 1], np.int32), prompt_len=4, params=SamplingParams(), num_draft=2)
    back = step_request_from_proto(step_request_to_proto(StepRequest([chunk])))
    assert back.chunks[0].num_draft == 2
    result = StepResult([SeqResult(3, token_id=5, logprob=-1.0, accepted_ids=[8], accepted_logprobs=[-0.5])], 3)
    got = step_result_from_proto(step_result_to_proto(result)).results[0]
    assert (got.token_id, got.accepted_ids, got.accepted_logprobs) == (5, [8], [-0.5])
    assert step_result_from_proto(step_result_to_proto(StepResult([SeqResult(1, 2)]))).results[0].accepted_ids == []
