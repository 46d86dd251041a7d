"""The contracts: committed generated code is current, services are complete, the step contract round-trips."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from protos import generate as protogen
from protos.tensorserve.v1 import common_pb2, router_pb2, scheduler_pb2, worker_pb2
from shared.sampling_params import SamplingParams
from shared.shm import ShmArena
from shared.tensor_codec import TensorCodec
from shared.step import SeqChunk, SeqResult, StepRequest, StepResult
from shared.step_codec import (sampling_params_from_proto, sampling_params_to_proto, step_request_from_proto,
                               step_request_to_proto, step_result_from_proto, step_result_to_proto)


# ----------------------------------------------------------------- generated code
def test_generated_code_is_not_stale(tmp_path: Path):
    fresh = protogen.generate(tmp_path)
    committed_dir = protogen.PROTOS_DIR / protogen.PACKAGE_DIR
    committed = sorted(p.name for p in committed_dir.iterdir() if protogen.is_generated(p))
    assert sorted(p.name for p in fresh) == committed, "generated modules differ: run `make protos`"
    for path in fresh:
        assert path.read_bytes() == (committed_dir / path.name).read_bytes(), \
            f"protos/{protogen.PACKAGE_DIR}/{path.name} is stale: run `make protos` and commit the result"


def test_generated_code_imports_from_the_installed_package():
    for path in (protogen.PROTOS_DIR / protogen.PACKAGE_DIR).iterdir():
        if protogen.is_generated(path):
            text = path.read_text()
            assert "from tensorserve.v1 import" not in text, path.name
            assert "BuildTopDescriptorsAndMessages(DESCRIPTOR, 'tensorserve" not in text, path.name
    assert worker_pb2.StepRequest.__module__ == "protos.tensorserve.v1.worker_pb2"


def _methods(pb2, service: str) -> dict[str, tuple[bool, bool]]:
    desc = pb2.DESCRIPTOR.services_by_name[service]
    return {m.name: (m.client_streaming, m.server_streaming) for m in desc.methods}


def test_services_are_complete():
    """Health is the standard grpc.health.v1 service on every process (shared/grpc_health.py), not ours."""
    assert common_pb2.DESCRIPTOR.package == "tensorserve.v1"
    assert _methods(router_pb2, "Generation") == {
        "Generate": (False, True), "Tokenize": (False, False), "Detokenize": (False, False),
        "ListModels": (False, False)}
    assert _methods(scheduler_pb2, "Scheduler") == {
        "Submit": (False, True), "Abort": (False, False), "Stats": (False, False),
        "RegisterWorker": (False, False), "WatchPrefixCache": (False, True)}
    assert _methods(worker_pb2, "Worker") == {
        "Describe": (False, False), "Step": (False, False), "StepStream": (True, True),
        "ExportBlocks": (False, False),
        "ImportBlocks": (False, False)}


# ----------------------------------------------------------------- sampling parameters
@pytest.mark.parametrize("params", [
    SamplingParams(),
    SamplingParams(max_tokens=256, temperature=0.0, seed=0, logprobs=0),
    SamplingParams(temperature=0.7, top_k=40, top_p=0.95, min_p=0.05, repetition_penalty=1.1,
                   presence_penalty=-0.5, frequency_penalty=1.3, seed=-12345, stop_token_ids=(2, 7, 0),
                   ignore_eos=True, logprobs=20),
    SamplingParams(seed=2**63 - 1, top_k=-1),
])
def test_sampling_params_round_trip(params: SamplingParams):
    wire = sampling_params_to_proto(params).SerializeToString()
    assert sampling_params_from_proto(common_pb2.SamplingParams.FromString(wire)) == params


def test_unset_sampling_fields_take_the_defaults():
    assert sampling_params_from_proto(common_pb2.SamplingParams()) == SamplingParams()
    got = sampling_params_from_proto(common_pb2.SamplingParams(temperature=0.0, logprobs=3))
    assert got == SamplingParams(temperature=0.0, logprobs=3)
    assert got.seed is None and sampling_params_from_proto(common_pb2.SamplingParams(seed=0)).seed == 0


# ----------------------------------------------------------------- step contract
def _assert_arrays_equal(a, b):
    if a is None or b is None:
        assert a is None and b is None
        return
    assert isinstance(b, np.ndarray)
    assert a.dtype == b.dtype and a.shape == b.shape
    np.testing.assert_array_equal(a, b)


def _assert_requests_equal(a: StepRequest, b: StepRequest):
    assert len(a.chunks) == len(b.chunks)
    for x, y in zip(a.chunks, b.chunks):
        _assert_arrays_equal(x.token_ids, y.token_ids)
        _assert_arrays_equal(x.block_table, y.block_table)
        for name in ("seq_id", "start_pos", "prompt_len", "sample", "params", "score_top_k"):
            assert getattr(x, name) == getattr(y, name), name
    assert a.finished == b.finished
    assert a.copy_blocks == b.copy_blocks


def _assert_results_equal(a: StepResult, b: StepResult):
    assert a.tokens_computed == b.tokens_computed and len(a.results) == len(b.results)
    for x, y in zip(a.results, b.results):
        assert (x.seq_id, x.token_id, x.logprob) == (y.seq_id, y.token_id, y.logprob)
        for name in ("top_ids", "top_logprobs", "score_ids", "score_logprobs"):
            _assert_arrays_equal(getattr(x, name), getattr(y, name))


def _request(prefill_len: int = 37) -> StepRequest:
    rng = np.random.default_rng(0)
    return StepRequest(
        chunks=[
            SeqChunk(seq_id=3, token_ids=rng.integers(0, 49152, prefill_len, dtype=np.int64), start_pos=0,
                     block_table=np.arange(-(-prefill_len // 16), dtype=np.int32), prompt_len=prefill_len,
                     sample=True, params=SamplingParams(temperature=0.8, seed=42, logprobs=5)),
            SeqChunk(seq_id=2**40, token_ids=np.array([17], np.int64), start_pos=900,
                     block_table=np.array([5, 9, 1, 7] * 15, np.int32), prompt_len=12, sample=True,
                     params=SamplingParams(temperature=0.0)),
            SeqChunk(seq_id=4, token_ids=np.array([1, 2, 3], np.int32), start_pos=16,
                     block_table=np.array([2, 4], np.int64), prompt_len=19, sample=False, params=None,
                     score_top_k=5),
        ],
        finished=[1, 11, 2**33],
        copy_blocks=[(7, 2), (0, 5)],
    )


def _result(score_len: int = 3) -> StepResult:
    rng = np.random.default_rng(1)
    return StepResult(
        results=[
            SeqResult(seq_id=3, token_id=1234, logprob=-0.123456789,
                      top_ids=np.array([1234, 5, 6, 7, 8], np.int64),
                      top_logprobs=rng.standard_normal(5).astype(np.float32)),
            SeqResult(seq_id=2**40, token_id=0, logprob=0.0),
            SeqResult(seq_id=4, score_ids=rng.integers(0, 49152, (score_len, 5)),
                      score_logprobs=rng.standard_normal((score_len, 5)).astype(np.float32)),
        ],
        tokens_computed=41,
    )


def _wire(msg):
    return type(msg).FromString(msg.SerializeToString())


def test_step_request_round_trip_inline():
    req = _request()
    msg = step_request_to_proto(req, step_id=9)
    assert msg.step_id == 9
    assert all(c.token_ids.WhichOneof("storage") == "inline_tensor" for c in msg.chunks)
    _assert_requests_equal(req, step_request_from_proto(_wire(msg)))


def test_step_result_round_trip_inline():
    res = _result()
    back = step_result_from_proto(_wire(step_result_to_proto(res)))
    _assert_results_equal(res, back)
    assert back.results[1].token_id == 0 and back.results[2].token_id == -1


def test_a_multi_step_request_and_its_later_results_round_trip():
    req = _request()
    req.num_steps = 8
    back = step_request_from_proto(_wire(step_request_to_proto(req)))
    assert back.num_steps == 8
    _assert_requests_equal(req, back)
    assert step_request_from_proto(worker_pb2.StepRequest()).num_steps == 1     # unset: one step
    res = _result()
    res.later = [[SeqResult(seq_id=3, token_id=7 + i, logprob=-0.5 * i), SeqResult(seq_id=2**40, token_id=i)]
                 for i in range(3)]
    back = step_result_from_proto(_wire(step_result_to_proto(res)))
    _assert_results_equal(res, back)
    assert [[(r.seq_id, r.token_id, r.logprob) for r in step] for step in back.later] == \
        [[(3, 7 + i, -0.5 * i), (2**40, i, 0.0)] for i in range(3)]
    assert step_result_from_proto(_wire(step_result_to_proto(_result()))).later == []


def test_step_round_trip_through_shared_memory():
    """Large arrays travel as TensorRefs in the sender's arena, small ones inline, in the same message."""
    with ShmArena(initial_bytes=4096) as arena:
        sender = TensorCodec("shm", arena=arena, shm_min_bytes=1024)
        receiver = TensorCodec("inline")                # decodes refs whatever it sends itself
        req = _request(prefill_len=5000)
        msg = _wire(step_request_to_proto(req, sender))
        kinds = [c.token_ids.WhichOneof("storage") for c in msg.chunks]
        assert kinds == ["ref", "inline_tensor", "inline_tensor"]
        _assert_requests_equal(req, step_request_from_proto(msg, receiver))

        res = _result(score_len=2000)                   # [2000, 5] ids and logprobs: refs
        msg = _wire(step_result_to_proto(res, sender))
        assert msg.results[2].score_logprobs.WhichOneof("storage") == "ref"
        assert msg.results[0].top_ids.WhichOneof("storage") == "inline_tensor"
        back = step_result_from_proto(msg, receiver)
        _assert_results_equal(res, back)

        # the next message reuses the segment; decoded arrays were copies and stay intact
        names = arena.segment_names
        step_result_to_proto(_result(score_len=2000), sender)
        assert arena.segment_names == names and len(names) == 1
        _assert_results_equal(res, back)
        receiver.close()
