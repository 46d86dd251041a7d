"""llama.cpp's block schedule (scheduler/diffusion/schedule.py), the diffusion step contract on the
wire (shared/step_codec.py), and the clear errors of bad diffusion parameters and model mix-ups."""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from conftest import FIXTURES
from scheduler.diffusion import BlockSchedule, DiffusionRequest
from shared.diffusion_params import DiffusionParams
from shared.step import DiffusionStep, SeqChunk, SeqResult, StepRequest, StepResult
from shared.step_codec import (step_request_from_proto, step_request_to_proto, step_result_from_proto,
                               step_result_to_proto)
from tiny_models import write_tiny_llama

MODEL = FIXTURES / "diffusion" / "tiny-llada.gguf"


def test_blocks_start_after_the_prompt_and_late_blocks_are_short_or_empty():
    s = BlockSchedule(14, DiffusionParams(gen_length=18, steps=8, block_length=8))
    assert s.blocks == [(14, 22), (22, 30), (30, 32), (32, 32)] and s.steps_per_block == 2
    s = BlockSchedule(14, DiffusionParams(gen_length=34, steps=12, block_length=4))
    assert len(s.blocks) == 12 and s.blocks[8] == (46, 48) and s.blocks[9:] == [(48, 48)] * 3


def test_transfer_counts_spread_the_masks_first_steps_first():
    assert BlockSchedule.transfer_counts(8, 2) == [4, 4]
    assert BlockSchedule.transfer_counts(5, 2) == [3, 2]
    assert BlockSchedule.transfer_counts(2, 4) == [1, 1, 0, 0]
    assert BlockSchedule.transfer_counts(7, 3) == [3, 2, 2]


def test_a_request_walks_its_blocks_and_reports_them():
    blocks = []
    r = DiffusionRequest([5, 6], DiffusionParams(gen_length=6, steps=8, block_length=4), mask_token_id=99,
                         on_block=lambda req, start, tokens: blocks.append((start, tokens)))
    assert r.canvas == [5, 6] + [99] * 6 and r.schedule.blocks == [(2, 6), (6, 8)]
    first = r.next_step()
    assert (first.block_start, first.block_end, first.transfer_count) == (2, 6, 1)   # 4 masks over 4 steps
    for step, pos in enumerate([2, 3, 4, 5]):
        assert r.next_step().transfer_count == 1
        r.apply(SeqResult(r.seq_id, committed_positions=np.array([pos]), committed_ids=np.array([10 + step])))
    assert blocks == [(2, [10, 11, 12, 13])] and not r.finished
    step = r.next_step()
    assert (step.block_start, step.block_end, step.transfer_count) == (6, 8, 1)     # 2 masks over 4 steps
    r.apply(SeqResult(r.seq_id, committed_positions=np.array([7]), committed_ids=np.array([21])))
    assert not r.finished
    r.apply(SeqResult(r.seq_id, committed_positions=np.array([6]), committed_ids=np.array([20])))
    # no mask left: the block ends before its 4 steps (llama.cpp's steps there change nothing)
    assert r.finished and r.steps_taken == 6 and r.output == [10, 11, 12, 13, 20, 21]
    assert blocks[-1] == (6, [20, 21])


def test_a_block_whose_steps_are_spent_ends_with_its_masks():
    # origin commits by coin flips: llama.cpp moves on after the block's steps whatever is left
    r = DiffusionRequest([5, 6, 7, 8], DiffusionParams(gen_length=4, steps=2, block_length=4, algorithm="origin"),
                         mask_token_id=99)
    assert r.schedule.blocks == [(4, 8), (8, 8)] and r.schedule.steps_per_block == 1
    r.apply(SeqResult(r.seq_id, committed_positions=np.array([5]), committed_ids=np.array([1])))
    assert r.finished and r.output == [99, 1, 99, 99]


def test_threshold_algorithms_take_steps_until_the_block_has_no_mask():
    r = DiffusionRequest([5], DiffusionParams(gen_length=3, steps=1, block_length=2, algorithm="low_confidence"),
                         mask_token_id=99)
    assert r.schedule.blocks == [(1, 3), (3, 4)] and r.next_step().transfer_count == -1
    for _ in range(5):
        r.apply(SeqResult(r.seq_id))                   # nothing committed: the block goes on
    assert r.block == 0 and not r.finished


def test_the_step_contract_carries_diffusion_chunks_and_commits():
    params = DiffusionParams(gen_length=10, steps=4, block_length=6, algorithm="entropy_bound", temperature=0.5,
                             top_k=7, top_p=0.8, seed=123, threshold=0.3, gamma=2.5)
    chunk = SeqChunk(7, np.arange(12, dtype=np.int64), 0, np.zeros(0, np.int32), 2, sample=False,
                     diffusion=DiffusionStep(2, 8, -1, params))
    back = step_request_from_proto(step_request_to_proto(StepRequest([chunk], finished=[3]))).chunks[0]
    assert back.diffusion == chunk.diffusion and back.diffusion.params == params
    assert np.array_equal(back.token_ids, chunk.token_ids) and not back.sample
    plain = step_request_from_proto(step_request_to_proto(StepRequest([SeqChunk(1, np.arange(3), 0, np.zeros(1), 3)])))
    assert plain.chunks[0].diffusion is None
    result = StepResult([SeqResult(7, committed_positions=np.array([5, 2]), committed_ids=np.array([40, 41])),
                         SeqResult(8)])
    got = step_result_from_proto(step_result_to_proto(result)).results
    assert got[0].committed_positions.tolist() == [5, 2] and got[0].committed_ids.tolist() == [40, 41]
    assert got[1].committed_positions is None


@pytest.mark.parametrize("kw, flag", [
    ({"gen_length": 0}, "--gen-length"), ({"steps": 0}, "--steps"), ({"algorithm": "greedy"}, "--algorithm"),
    ({"threshold": 0.0}, "--threshold"), ({"threshold": 1.5}, "--threshold"), ({"top_p": 0.0}, "--top-p"),
    ({"block_length": 5}, "--block-length"), ({"steps": 3}, "--steps"), ({"temperature": -1.0}, "--temperature"),
])
def test_bad_parameters_name_their_flag(kw, flag):
    base = dict(gen_length=14, steps=4, block_length=8)       # with a 2-token prompt: 2 blocks
    with pytest.raises(ValueError, match=flag):
        DiffusionParams(**{**base, **kw}).validate(n_prompt=2)


def _tensorserve(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tensorserve", *args], capture_output=True, text=True, timeout=300)


def test_cli_errors_exit_2_with_the_flag_and_no_traceback(tmp_path):
    ar_model = write_tiny_llama(tmp_path / "tiny-llama.gguf")
    cases = [
        (("diffuse", "--model", str(ar_model), "--prompt", "x"), "not a text-diffusion model"),
        (("generate", "--model", str(MODEL), "--prompt", "x"), "tensorserve diffuse"),
        (("diffuse", "--model", str(MODEL), "--prompt", "x", "--gen-length", "0"), "--gen-length"),
        (("diffuse", "--model", str(MODEL), "--prompt", "x", "--algorithm", "best"), "--algorithm"),
        (("diffuse", "--model", str(MODEL), "--prompt", "x", "--threshold", "2"), "--threshold"),
        (("diffuse", "--model", str(MODEL), "--prompt", "x", "--gen-length", "17", "--block-length", "8"),
         "--block-length 8 must divide"),
    ]
    for args, message in cases:
        out = _tensorserve(*args)
        assert out.returncode == 2 and message in out.stderr and "Traceback" not in out.stderr, (args, out.stderr)


def test_diffuse_help_names_every_flag():
    out = _tensorserve("diffuse", "--help")
    assert out.returncode == 0
    for flag in ("--gen-length", "--steps", "--block-length", "--algorithm", "--top-k", "--top-p", "--temperature",
                 "--seed", "--threshold", "--gamma", "--chat", "--prompt", "--model"):
        assert flag in out.stdout
