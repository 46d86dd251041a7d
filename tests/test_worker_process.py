"""The kernel-worker process: a real `python -m worker.main` subprocess and a real gRPC client.

One worker (SmolLM2, 64 MiB of KV) is shared by the module; the crash and
start-up failure tests start their own.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import grpc
import numpy as np
import pytest

from processes import start_with_ready_file, stop
from protos.tensorserve.v1 import worker_pb2, worker_pb2_grpc
from shared import grpc_health
from shared.sampling_params import SamplingParams
from shared.shm import SHM_DIR
from shared.tensor_codec import TensorCodec
from worker.server import TRANSPORT_METADATA_KEY
from shared.step import SeqChunk, StepRequest
from shared.step_codec import step_request_to_proto, step_result_from_proto
from tests.conftest import load_fixture

REPO = Path(__file__).resolve().parent.parent
MODEL = "smollm2-135m"
KV_MEMORY = "64MiB"
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, logprobs=2)
INLINE_MD = (("ts-tensor-transport", "inline"),)
SHM_MD = (("ts-tensor-transport", "shm"),)
CHANNEL_OPTIONS = [("grpc.max_send_message_length", 256 * 2**20),
                   ("grpc.max_receive_message_length", 256 * 2**20)]

pytestmark = pytest.mark.skipif(not SHM_DIR.is_dir(), reason="needs /dev/shm")


# ----------------------------------------------------------------- helpers
def _segments_of(pid: int) -> list[str]:
    return sorted(n for n in os.listdir(SHM_DIR) if n.startswith(f"ts-{pid}-"))


def start_worker(tmp: Path, *extra: str, name: str = "worker") -> tuple[subprocess.Popen, str]:
    ready = tmp / f"{name}.ready.json"
    proc, info = start_with_ready_file([sys.executable, "-m", "worker.main", "--model", MODEL, "--port", "0",
                                        "--kv-memory", KV_MEMORY, "--ready-file", str(ready), *extra],
                                       ready, tmp / f"{name}.log", timeout=60, env={"PYTHONPATH": str(REPO)},
                                       name="worker")
    assert info["pid"] == proc.pid
    return proc, info["address"]


def stub_for(address: str) -> tuple[grpc.Channel, worker_pb2_grpc.WorkerStub]:
    channel = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
    grpc.channel_ready_future(channel).result(timeout=10)
    return channel, worker_pb2_grpc.WorkerStub(channel)


def chunk(seq_id: int, tokens, start_pos: int, blocks, prompt_len: int, params=GREEDY, **kw) -> SeqChunk:
    return SeqChunk(seq_id=seq_id, token_ids=np.asarray(tokens, np.int64), start_pos=start_pos,
                    block_table=np.asarray(blocks, np.int32), prompt_len=prompt_len, params=params, **kw)


def all_tensors(response: worker_pb2.StepResponse):
    for r in response.results:
        for name in ("top_ids", "top_logprobs", "score_ids", "score_logprobs"):
            if r.HasField(name):
                yield getattr(r, name)


# ----------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("worker")
    proc, address = start_worker(tmp)
    channel, stub = stub_for(address)
    yield proc, address, stub
    channel.close()
    assert stop(proc) == 0
    assert _segments_of(proc.pid) == []


@pytest.fixture(scope="module")
def runner():
    """The in-process expectation: the same ModelRunner the worker wraps, with the same KV budget."""
    from shared.model_registry import resolve_model
    from shared.option_kinds import parse_size
    from worker.model_runner import ModelRunner
    return ModelRunner(resolve_model(MODEL), kv_memory=parse_size(KV_MEMORY))


@pytest.fixture(scope="module")
def fixture_case():
    return load_fixture(MODEL)["generate"][0]


# ----------------------------------------------------------------- tests
def test_describe_reports_capacity(worker, runner):
    _, _, stub = worker
    d = stub.Describe(worker_pb2.DescribeRequest(), timeout=10)
    cap, cfg = runner.capacity, runner.config
    assert d.model_name == MODEL
    assert d.architecture == "llama"
    assert d.fingerprint == cfg.fingerprint and len(d.fingerprint) >= 16
    assert d.vocab_size == cfg.vocab_size == 49152
    assert (d.num_blocks, d.block_size, d.max_context) == (cap.num_blocks, cap.block_size, cap.max_context)
    assert d.num_blocks > 0 and d.block_size == 16 and 0 < d.max_context <= d.num_blocks * d.block_size
    assert d.n_layers == cfg.n_layers and d.backend == "cpu" and d.hostname


def test_health_serving(worker):
    _, _, stub = worker
    # the standard grpc.health.v1 service, for the server and for the Worker service
    address = worker[1]
    assert grpc_health.check(address) and grpc_health.check(address, "tensorserve.v1.Worker")
    assert not grpc_health.check(address, "tensorserve.v1.NoSuchService")
    d = stub.Describe(worker_pb2.DescribeRequest(), timeout=10)
    assert d.num_blocks > 0 and d.model_name == MODEL


def test_prefill_matches_in_process_runner(worker, runner, fixture_case):
    _, _, stub = worker
    prompt = fixture_case["prompt_tokens"]
    req = StepRequest([chunk(101, prompt, 0, [0], len(prompt))])
    want = runner.execute(req).results[0]
    runner.execute(StepRequest([], finished=[101]))
    resp = stub.Step(step_request_to_proto(req, step_id=7), timeout=30, metadata=INLINE_MD)
    assert resp.step_id == 7 and resp.tokens_computed == len(prompt)
    got = step_result_from_proto(resp).results[0]
    assert got.seq_id == 101
    assert got.token_id == want.token_id == fixture_case["greedy_continuation"][0]
    assert got.logprob == pytest.approx(want.logprob, abs=1e-5)
    np.testing.assert_array_equal(got.top_ids, want.top_ids)
    stub.Step(worker_pb2.StepRequest(finished=[101]), timeout=10)


def test_greedy_decode_matches_llama_cpp(worker, fixture_case):
    """Prefill, then one decode token per step through its growing block table (inline transport)."""
    _, _, stub = worker
    prompt, expected = fixture_case["prompt_tokens"], fixture_case["greedy_continuation"][:5]
    codec = TensorCodec("inline")
    seq, tokens, out = 102, list(prompt), []
    blocks = [3]                                     # not block 0: the table is really read
    feed, start = list(prompt), 0
    for step_id in range(len(expected)):
        req = StepRequest([chunk(seq, feed, start, blocks, len(prompt))])
        resp = stub.Step(step_request_to_proto(req, codec, step_id=step_id), timeout=30, metadata=INLINE_MD)
        assert all(t.WhichOneof("storage") == "inline_tensor" for t in all_tensors(resp))
        token = step_result_from_proto(resp, codec).results[0].token_id
        out.append(token)
        start, feed = len(tokens), [token]
        tokens.append(token)
    stub.Step(worker_pb2.StepRequest(finished=[seq]), timeout=10)
    assert out == expected


def test_step_stream_answers_pipelined_steps_in_order(worker, fixture_case):
    """StepStream, as the scheduler drives it: the prefill and two decode steps whose token is the
    placeholder -1 are all sent before the first answer is read; the answers come in order and
    continue greedily as llama.cpp does. A refused step then ends the stream with INVALID_ARGUMENT."""
    _, _, stub = worker
    prompt, expected = fixture_case["prompt_tokens"], fixture_case["greedy_continuation"][:3]
    seq, blocks, n = 113, [4, 5], len(fixture_case["prompt_tokens"])
    steps = [StepRequest([chunk(seq, prompt, 0, blocks, n)])]
    steps += [StepRequest([chunk(seq, [-1], n + i, blocks, n, params=None)]) for i in range(2)]
    steps.append(StepRequest([], finished=[seq]))
    answers = list(stub.StepStream(iter([step_request_to_proto(r, step_id=i + 1) for i, r in enumerate(steps)]),
                                   timeout=60, metadata=INLINE_MD))
    assert [a.step_id for a in answers] == [1, 2, 3, 4]
    assert [step_result_from_proto(a).results[0].token_id for a in answers[:3]] == expected

    bad = StepRequest([chunk(114, [1, 2, 10**7], 0, [0], 3)])
    with pytest.raises(grpc.RpcError) as info:
        list(stub.StepStream(iter([step_request_to_proto(bad, step_id=1)]), timeout=30))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "token ids" in info.value.details()
    stub.Step(worker_pb2.StepRequest(finished=[114]), timeout=10)
    assert grpc_health.check(worker[1])


def test_shm_and_inline_transports_agree(worker, runner, fixture_case):
    """Request tensors as TensorRefs (forced even when small), response score arrays back through the
    worker's arena; the same step inline gives the same arrays."""
    _, _, stub = worker
    prompt = fixture_case["prompt_tokens"]
    k = 256                                          # [5, 256] int64 ids: over the 4 KiB shm threshold
    req = StepRequest([chunk(103, prompt, 0, [7], len(prompt), score_top_k=k)])
    want = runner.execute(req).results[0]
    runner.execute(StepRequest([], finished=[103]))

    shm_codec = TensorCodec("shm", shm_min_bytes=0)
    msg = step_request_to_proto(req, shm_codec, step_id=1)
    assert msg.chunks[0].token_ids.HasField("ref") and msg.chunks[0].block_table.HasField("ref")
    resp = stub.Step(msg, timeout=30)              # auto transport: refs in, refs back
    refs = [t.ref.shm_name for t in all_tensors(resp) if t.HasField("ref")]
    assert refs and all(name.startswith(f"ts-{worker[0].pid}-") for name in refs)
    via_shm = step_result_from_proto(resp, shm_codec).results[0]
    stub.Step(worker_pb2.StepRequest(finished=[103]), timeout=10)

    resp = stub.Step(step_request_to_proto(req, step_id=2), timeout=30, metadata=INLINE_MD)
    assert all(t.WhichOneof("storage") == "inline_tensor" for t in all_tensors(resp))
    via_inline = step_result_from_proto(resp).results[0]
    stub.Step(worker_pb2.StepRequest(finished=[103]), timeout=10)
    shm_codec.close()

    for got in (via_shm, via_inline):
        assert got.token_id == want.token_id
        assert got.score_ids.shape == (len(prompt), k)
        np.testing.assert_array_equal(got.score_ids, want.score_ids)
        np.testing.assert_allclose(got.score_logprobs, want.score_logprobs, atol=1e-5)


def test_bad_steps_are_invalid_argument_and_worker_stays_up(worker):
    _, _, stub = worker
    too_short = StepRequest([chunk(104, list(range(1, 40)), 0, [0, 1], 39)])      # 39 tokens need 3 blocks
    no_params = StepRequest([chunk(105, [1, 2, 3], 0, [0], 3, params=None)])     # unknown seq, no params
    bad_block = StepRequest([chunk(106, [1, 2, 3], 0, [10**6], 3)])
    bad_token = StepRequest([chunk(107, [1, 2, 10**7], 0, [0], 3)])
    bad_params = StepRequest([chunk(108, [1, 2, 3], 0, [0], 3, params=SamplingParams(temperature=-1))])
    bad_copy = StepRequest([chunk(110, [1, 2, 3], 0, [0], 3)], copy_blocks=[(10**6, 0)])
    for req, words in ((too_short, "block table"), (no_params, "sampling parameters"),
                       (bad_block, "block ids"), (bad_token, "token ids"), (bad_params, "temperature"),
                       (bad_copy, "block copy")):
        with pytest.raises(grpc.RpcError) as info:
            stub.Step(step_request_to_proto(req), timeout=30)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
        assert words in info.value.details()
    ref = worker_pb2.StepRequest()
    c = ref.chunks.add(seq_id=109, start_pos=0, prompt_len=1)
    c.token_ids.ref.shm_name, c.token_ids.ref.dtype = "ts-1-dead-0", "<i8"
    c.token_ids.ref.shape[:] = [1]
    with pytest.raises(grpc.RpcError) as info:
        stub.Step(ref, timeout=30)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "gone" in info.value.details()
    stub.Step(worker_pb2.StepRequest(finished=[104, 105, 106, 107, 108, 109, 110]), timeout=10)
    assert grpc_health.check(worker[1])
    assert worker[0].poll() is None


def test_a_copied_block_continues_a_prompt_as_the_original_would(worker):
    """copy_blocks: a sequence whose first block is a copy of another's computes the rest of the
    same prompt and samples what the original sampled."""
    _, _, stub = worker
    prompt = list(range(300, 320))                                  # one full block of 16 + 4
    a = step_result_from_proto(stub.Step(step_request_to_proto(
        StepRequest([chunk(111, prompt, 0, [2, 3], len(prompt))])), timeout=30)).results[0]
    b_chunk = chunk(112, prompt[16:], 16, [6, 7], len(prompt))
    b_chunk.prefix_ids = np.asarray(prompt[:16], np.int64)
    b = step_result_from_proto(stub.Step(step_request_to_proto(
        StepRequest([b_chunk], copy_blocks=[(2, 6)])), timeout=30)).results[0]
    assert b.token_id == a.token_id and abs(b.logprob - a.logprob) < 1e-4
    stub.Step(worker_pb2.StepRequest(finished=[111, 112]), timeout=10)


@pytest.mark.parametrize("transport", ["shm", "inline"])
def test_exported_blocks_imported_elsewhere_continue_the_prompt_exactly(worker, transport):
    """ExportBlocks of a prefilled prompt's two full blocks, ImportBlocks into two other blocks
    (through shared memory, or inline as between hosts): a sequence on the imported blocks
    computes the rest of the prompt and samples what the original did, with the same logprob."""
    _, _, stub = worker
    md = ((TRANSPORT_METADATA_KEY, transport),)
    prompt = list(range(400, 436))                                   # two full blocks of 16 + 4
    a = step_result_from_proto(stub.Step(step_request_to_proto(
        StepRequest([chunk(121, prompt, 0, [20, 21, 22], len(prompt))])), timeout=30)).results[0]
    exported = stub.ExportBlocks(worker_pb2.ExportBlocksRequest(blocks=worker_pb2.BlockRange(block_ids=[20, 21])),
                                 timeout=30, metadata=md)
    kind = "ref" if transport == "shm" else "inline_tensor"
    assert exported.kv.WhichOneof("storage") == kind
    reader = TensorCodec("inline")
    kv = reader.decode(exported.kv)
    assert kv.shape[:3] == (2, kv.shape[1], 2) and kv.dtype == np.float16      # blocks, layers, K/V
    stub.ImportBlocks(worker_pb2.ImportBlocksRequest(blocks=worker_pb2.BlockRange(block_ids=[30, 31]),
                                                     kv=reader.encode(kv)), timeout=30)
    b_chunk = chunk(122, prompt[32:], 32, [30, 31, 32], len(prompt))
    b_chunk.prefix_ids = np.asarray(prompt[:32], np.int64)
    b = step_result_from_proto(stub.Step(step_request_to_proto(StepRequest([b_chunk])), timeout=30)).results[0]
    assert b.token_id == a.token_id and b.logprob == a.logprob
    stub.Step(worker_pb2.StepRequest(finished=[121, 122]), timeout=10)


def test_block_transfers_that_do_not_fit_are_invalid_argument(worker):
    _, address, stub = worker
    exported = stub.ExportBlocks(worker_pb2.ExportBlocksRequest(blocks=worker_pb2.BlockRange(block_ids=[1])),
                                 timeout=30)
    reader = TensorCodec("inline")
    good = reader.decode(exported.kv)
    one = worker_pb2.BlockRange(block_ids=[5])
    cases = [
        (stub.ExportBlocks, worker_pb2.ExportBlocksRequest(), "no block ids"),
        (stub.ExportBlocks, worker_pb2.ExportBlocksRequest(blocks=worker_pb2.BlockRange(block_ids=[10**6])), "outside"),
        (stub.ImportBlocks, worker_pb2.ImportBlocksRequest(blocks=one, kv=reader.encode(good[:, :-1])), "shape"),
        (stub.ImportBlocks, worker_pb2.ImportBlocksRequest(blocks=worker_pb2.BlockRange(block_ids=[5, 6]),
                                                           kv=exported.kv), "shape"),
        (stub.ImportBlocks, worker_pb2.ImportBlocksRequest(blocks=one, kv=reader.encode(good.astype(np.float64))),
         "dtype"),
        (stub.ImportBlocks, worker_pb2.ImportBlocksRequest(blocks=one, kv=reader.encode(np.full_like(good, np.nan))),
         "NaN"),
        (stub.ImportBlocks, worker_pb2.ImportBlocksRequest(blocks=one), "neither"),
    ]
    for call, request, words in cases:
        with pytest.raises(grpc.RpcError) as info:
            call(request, timeout=10)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and words in info.value.details()
    assert grpc_health.check(address)


def test_max_context_too_large_fails_at_start_with_numbers():
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, "-m", "worker.main", "--model", MODEL, "--kv-memory", "8MiB",
                           "--max-context", "4096"], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 2
    assert "--max-context 4096 (flag)" in proc.stderr            # what was asked, and where
    assert "--kv-memory 8MiB (flag) holds 352 tokens" in proc.stderr   # what the budget holds
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


def test_kill9_leaves_nothing_after_restart_and_sigterm_exits_clean(tmp_path):
    proc, address = start_worker(tmp_path, "--tensor-transport", "shm", name="doomed")
    channel, stub = stub_for(address)
    req = StepRequest([chunk(1, [1, 2, 3, 4, 5], 0, [0], 5, score_top_k=256)])
    resp = stub.Step(step_request_to_proto(req), timeout=30)
    assert any(t.HasField("ref") for t in all_tensors(resp))
    channel.close()
    assert _segments_of(proc.pid), "the worker should hold a live segment"
    proc.kill()
    proc.wait()
    dead = proc.pid
    assert _segments_of(dead), "SIGKILL cannot clean up: the restart must"

    proc2, address2 = start_worker(tmp_path, "--tensor-transport", "shm", name="restarted")
    try:
        assert _segments_of(dead) == []
        channel, stub = stub_for(address2)
        resp = stub.Step(step_request_to_proto(req), timeout=30)
        assert any(t.HasField("ref") for t in all_tensors(resp))
        channel.close()
        assert _segments_of(proc2.pid)
    finally:
        rc = stop(proc2)
    assert rc == 0
    assert _segments_of(proc2.pid) == []


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.0, max_tokens=16), GREEDY],
                         ids=["greedy", "greedy-with-logprobs"])
def test_a_request_of_several_steps_decodes_as_llama_cpp(worker, fixture_case, params):
    """A prefill, then one StepRequest of num_steps=4 from the placeholder token: the response holds
    the four tokens llama.cpp continues with, step by step (greedy without logprobs: in one replayed
    call; with logprobs: the worker's step-by-step path, logprobs included). A prompt chunk in a
    request of several steps is refused, naming the rule, and the worker stays up."""
    _, _, stub = worker
    prompt, expected = fixture_case["prompt_tokens"], fixture_case["greedy_continuation"][:5]
    seq, n = 131, len(fixture_case["prompt_tokens"])
    blocks = list(range(6, 6 + -(-(n + 4) // 16)))
    first = step_result_from_proto(stub.Step(step_request_to_proto(
        StepRequest([chunk(seq, prompt, 0, blocks, n, params=params)])), timeout=180))
    resp = step_result_from_proto(stub.Step(step_request_to_proto(
        StepRequest([chunk(seq, [-1], n, blocks, n, params=None)], num_steps=4)), timeout=180))
    steps = [resp.results] + resp.later
    assert [first.results[0].token_id] + [s[0].token_id for s in steps] == expected
    assert resp.tokens_computed == 4
    if params.logprobs:
        assert all(s[0].logprob < 0 and len(s[0].top_ids) == 2 for s in steps)
    stub.Step(worker_pb2.StepRequest(finished=[seq]), timeout=10)

    with pytest.raises(grpc.RpcError) as info:
        stub.Step(step_request_to_proto(StepRequest([chunk(132, [1, 2, 3], 0, [0], 3)], num_steps=2)), timeout=180)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "one decode token" in info.value.details()
    assert grpc_health.check(worker[1])
