"""The scheduler process against a real worker process, over gRPC.

One worker + scheduler pair (module scope) serves the generation tests; a
second pair, whose worker gets killed, serves the failure, recovery and
SIGTERM tests.
"""
from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest

from agreement import greedy_prefix_to_check
from conftest import load_fixture
from processes import start_with_ready_file, stop, wait_for
from shared import grpc_health
from protos.tensorserve.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc

FIXTURE = load_fixture("smollm2-135m")
CASE = FIXTURE["generate"][0]
SERVING = common_pb2.SERVING_STATUS_SERVING
NOT_SERVING = common_pb2.SERVING_STATUS_NOT_SERVING


def start_worker(tmp: Path, name: str, port: int = 0) -> tuple[subprocess.Popen, str]:
    ready = tmp / f"{name}.json"
    proc, info = start_with_ready_file([sys.executable, "-m", "worker.main", "--model", "smollm2-135m", "--port",
                                        str(port), "--kv-memory", "64MiB", "--ready-file", str(ready)],
                                       ready, tmp / f"{name}.log")
    return proc, info["address"]


def start_scheduler(tmp: Path, name: str, *extra: str) -> tuple[subprocess.Popen, str]:
    ready = tmp / f"{name}.json"
    proc, info = start_with_ready_file([sys.executable, "-m", "scheduler.main", "--port", "0", "--ready-file",
                                        str(ready), "--grace-period", "20", *extra], ready, tmp / f"{name}.log")
    return proc, info["address"]


def submit_request(prompt, max_tokens, request_id="", **sampling) -> scheduler_pb2.SubmitRequest:
    sampling.setdefault("temperature", 0.0)
    return scheduler_pb2.SubmitRequest(request_id=request_id, prompt_token_ids=prompt,
                                       sampling=common_pb2.SamplingParams(max_tokens=max_tokens, **sampling))


def collect(stub, request, timeout=180.0) -> tuple[list[int], scheduler_pb2.SubmitEvent, list]:
    tokens, events = [], []
    for ev in stub.Submit(request, timeout=timeout):
        events.append(ev)
        tokens += [t.token_id for t in ev.tokens]
    return tokens, events[-1], events


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sched")
    worker, worker_addr = start_worker(tmp, "worker")
    sched, addr = start_scheduler(tmp, "scheduler", "--worker", worker_addr)
    channel = grpc.insecure_channel(addr)
    stub = scheduler_pb2_grpc.SchedulerStub(channel)
    assert wait_for(lambda: stub.Stats(scheduler_pb2.StatsRequest()).status == SERVING, 30), \
        (tmp / "scheduler.log").read_text()
    stub.log_path = tmp / "scheduler.log"
    yield stub
    channel.close()
    stop(sched)
    stop(worker)


def test_greedy_matches_llama_cpp(stack):
    tokens, last, events = collect(stack, submit_request(CASE["prompt_tokens"], 12, ignore_eos=True))
    n = greedy_prefix_to_check(CASE)
    assert n >= 5
    assert tokens[:n] == CASE["greedy_continuation"][:n]
    assert last.finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert (last.usage.prompt_tokens, last.usage.completion_tokens, last.usage.total_tokens) == \
        (len(CASE["prompt_tokens"]), 12, len(CASE["prompt_tokens"]) + 12)
    assert all(len(ev.tokens) <= 1 for ev in events)


def test_concurrent_submits_all_complete(stack):
    solo, _, _ = collect(stack, submit_request(CASE["prompt_tokens"], 10, ignore_eos=True))
    prompts = [CASE["prompt_tokens"], [1, 2, 3, 4, 5, 6, 7], CASE["prompt_tokens"], list(range(100, 140))]
    results: dict[int, tuple] = {}

    def run(i):
        results[i] = collect(stack, submit_request(prompts[i], 6 + i if i != 2 else 10, request_id=f"c{i}",
                                                    ignore_eos=True))
    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(200)
    assert sorted(results) == [0, 1, 2, 3]
    for i, (tokens, last, _) in results.items():
        assert last.finish_reason == common_pb2.FINISH_REASON_LENGTH, last
        assert len(tokens) == (6 + i if i != 2 else 10)
    assert results[2][0] == solo                     # batched greedy == alone
    assert results[0][0] == solo[:6]
    stats = stack.Stats(scheduler_pb2.StatsRequest())
    assert stats.steps > 0 and stats.tokens_computed > 0


def test_logprobs_and_prompt_logprobs(stack):
    req = submit_request(CASE["prompt_tokens"], 3, logprobs=2, ignore_eos=True)
    req.prompt_logprobs = 1
    tokens, last, events = collect(stack, req)
    n = greedy_prefix_to_check(CASE)
    assert tokens == CASE["greedy_continuation"][:3][:n] + tokens[n:]
    first = events[0]
    assert [p.token_id for p in first.prompt_logprobs] == CASE["prompt_tokens"][1:]
    assert all(len(p.top_ids) == 1 for p in first.prompt_logprobs)
    assert all(len(ev.prompt_logprobs) == 0 for ev in events[1:])
    for ev in events:
        for t in ev.tokens:
            assert len(t.top_ids) == 2 and t.top_ids[0] == t.token_id and t.logprob <= 0
    # scoring only: max_tokens 0 with prompt_logprobs
    req = submit_request(CASE["prompt_tokens"], 0)
    req.prompt_logprobs = 0
    tokens, last, events = collect(stack, req)
    assert tokens == [] and last.finish_reason == common_pb2.FINISH_REASON_SCORED
    assert len(events[0].prompt_logprobs) == len(CASE["prompt_tokens"]) - 1


def test_cancel_frees_kv(stack):
    call = stack.Submit(submit_request(CASE["prompt_tokens"] * 20, 1000, request_id="long", ignore_eos=True))
    got = 0
    for ev in call:
        got += len(ev.tokens)
        if got >= 3:
            break
    busy = stack.Stats(scheduler_pb2.StatsRequest())
    assert busy.running == 1 and busy.kv_blocks_free < busy.kv_blocks_total
    call.cancel()

    def released():
        s = stack.Stats(scheduler_pb2.StatsRequest())
        return s if s.running == 0 and s.waiting == 0 and s.kv_blocks_free == s.kv_blocks_total else None
    s = wait_for(released, 5)
    assert s, stack.Stats(scheduler_pb2.StatsRequest())
    assert s.kv_used_fraction == 0 and s.block_size == 16 and s.max_context > 0


def test_abort_rpc_ends_the_stream(stack):
    call = stack.Submit(submit_request(CASE["prompt_tokens"], 1000, request_id="to-abort", ignore_eos=True))
    events = []
    for ev in call:
        events.append(ev)
        if len(events) == 2:
            assert stack.Abort(scheduler_pb2.AbortRequest(request_id="to-abort")).found
    assert events[-1].finish_reason == common_pb2.FINISH_REASON_ABORT
    assert not stack.Abort(scheduler_pb2.AbortRequest(request_id="to-abort")).found
    s = wait_for(lambda: (x := stack.Stats(scheduler_pb2.StatsRequest())).kv_blocks_free == x.kv_blocks_total, 5)
    assert s


def test_end_of_generation_ids_end_a_sequence(stack):
    free, _, _ = collect(stack, submit_request(CASE["prompt_tokens"], 6))
    request = submit_request(CASE["prompt_tokens"], 6)
    request.eos_token_ids[:] = [free[2]]
    tokens, last, _ = collect(stack, request)
    assert tokens == free[:free.index(free[2]) + 1] and last.finish_reason == common_pb2.FINISH_REASON_STOP
    request.sampling.ignore_eos = True
    assert collect(stack, request)[0] == free
    request.eos_token_ids[:] = [60000]
    with pytest.raises(grpc.RpcError) as err:
        collect(stack, request)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "end-of-generation token id 60000" in \
        err.value.details()


@pytest.mark.parametrize("prompt,sampling,words", [
    ([], {}, ["empty"]),
    ([5] * 4000, {}, ["4000", "context holds"]),    # 64 MiB of f16 KV: 2912 tokens
    ([5, 60000], {}, ["60000", "vocabulary"]),
    ([5, 6], {"temperature": 3.0}, ["temperature"]),
])
def test_invalid_requests(stack, prompt, sampling, words):
    with pytest.raises(grpc.RpcError) as err:
        collect(stack, submit_request(prompt, 4, **sampling))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    for w in words:
        assert w in err.value.details()
    if len(prompt) == 2000:
        max_context = stack.Stats(scheduler_pb2.StatsRequest()).max_context
        assert str(max_context) in err.value.details()


# ----------------------------------------------------------------- failure, recovery, shutdown
@pytest.fixture(scope="module")
def fragile(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fragile")
    procs = {}
    procs["scheduler"], addr = start_scheduler(tmp, "scheduler")      # no --worker: waits for RegisterWorker
    channel = grpc.insecure_channel(addr)
    stub = scheduler_pb2_grpc.SchedulerStub(channel)
    stub.address = addr
    yield tmp, procs, stub
    channel.close()
    for p in procs.values():
        stop(p)


def test_register_worker_then_kill_and_recover(fragile):
    tmp, procs, stub = fragile
    h = stub.Stats(scheduler_pb2.StatsRequest())
    assert h.status == NOT_SERVING and "worker" in h.status_message
    assert not grpc_health.check(stub.address) and not grpc_health.check(stub.address, "tensorserve.v1.Scheduler")
    with pytest.raises(grpc.RpcError) as err:
        collect(stub, submit_request(CASE["prompt_tokens"], 2), timeout=10)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "worker" in err.value.details()

    procs["worker"], worker_addr = start_worker(tmp, "worker")
    assert stub.RegisterWorker(scheduler_pb2.RegisterWorkerRequest(worker_id="w0", address=worker_addr)).accepted
    assert wait_for(lambda: stub.Stats(scheduler_pb2.StatsRequest()).status == SERVING, 20)
    assert wait_for(lambda: grpc_health.check(stub.address, "tensorserve.v1.Scheduler"), 5)

    call = stub.Submit(submit_request(CASE["prompt_tokens"], 1000, ignore_eos=True), timeout=30)
    events = []
    t_kill = None
    for ev in call:
        events.append(ev)
        if len(events) == 3:
            procs["worker"].kill()
            procs["worker"].wait()
            t_kill = time.monotonic()
    last = events[-1]
    assert time.monotonic() - t_kill < 5
    assert last.finish_reason == common_pb2.FINISH_REASON_ERROR
    assert last.error.code == "worker_unavailable"
    assert worker_addr in last.error.message and "restart the worker" in last.error.message
    h = stub.Stats(scheduler_pb2.StatsRequest())
    assert h.status == NOT_SERVING and worker_addr in h.status_message
    assert wait_for(lambda: not grpc_health.check(stub.address), 5)
    with pytest.raises(grpc.RpcError) as err:
        collect(stub, submit_request(CASE["prompt_tokens"], 2), timeout=10)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert procs["scheduler"].poll() is None

    # a worker back on the same address: the scheduler re-dials it and serves again
    port = int(worker_addr.rsplit(":", 1)[1])
    procs["worker"], _ = start_worker(tmp, "worker2", port=port)
    assert wait_for(lambda: stub.Stats(scheduler_pb2.StatsRequest()).status == SERVING, 20)
    tokens, last, _ = collect(stub, submit_request(CASE["prompt_tokens"], 5, ignore_eos=True))
    assert tokens == CASE["greedy_continuation"][:5] and last.finish_reason == common_pb2.FINISH_REASON_LENGTH
    s = stub.Stats(scheduler_pb2.StatsRequest())
    assert s.running == 0 and s.kv_blocks_free == s.kv_blocks_total


def test_a_hung_worker_fails_requests_in_seconds_not_at_the_step_timeout(tmp_path):
    """SIGSTOP the worker mid-request: the scheduler notices that Health gets no answer either,
    ends the request with an error, and serves again once the worker continues."""
    worker, worker_addr = start_worker(tmp_path, "worker")
    ready = tmp_path / "scheduler.json"
    scheduler, info = start_with_ready_file([sys.executable, "-m", "scheduler.main", "--port", "0", "--worker",
                                             worker_addr, "--ready-file", str(ready)], ready,
                                            tmp_path / "scheduler.log", env={"TS_WORKER_PROBE_AFTER_S": "1"})
    channel = grpc.insecure_channel(info["address"])
    stub = scheduler_pb2_grpc.SchedulerStub(channel)
    try:
        assert wait_for(lambda: stub.Stats(scheduler_pb2.StatsRequest()).status == SERVING, 30)
        events, t_stop = [], None
        for ev in stub.Submit(submit_request(CASE["prompt_tokens"], 1000, ignore_eos=True), timeout=60):
            events.append(ev)
            if len(events) == 2:
                worker.send_signal(signal.SIGSTOP)
                t_stop = time.monotonic()
        waited = time.monotonic() - t_stop
        last = events[-1]
        assert last.finish_reason == common_pb2.FINISH_REASON_ERROR and "stopped answering" in last.error.message
        assert waited < 15
        worker.send_signal(signal.SIGCONT)
        assert wait_for(lambda: stub.Stats(scheduler_pb2.StatsRequest()).status == SERVING, 30)
        tokens, last, _ = collect(stub, submit_request(CASE["prompt_tokens"], 4, ignore_eos=True), timeout=60)
        assert tokens == CASE["greedy_continuation"][:4]
    finally:
        worker.send_signal(signal.SIGCONT)
        channel.close()
        stop(scheduler)
        stop(worker)


def test_sigterm_finishes_in_flight_then_exits(fragile):
    tmp, procs, stub = fragile
    assert wait_for(lambda: stub.Stats(scheduler_pb2.StatsRequest()).status == SERVING, 20)
    call = stub.Submit(submit_request(CASE["prompt_tokens"], 12, ignore_eos=True), timeout=60)
    events = []
    for ev in call:
        events.append(ev)
        if len(events) == 2:
            procs["scheduler"].send_signal(signal.SIGTERM)
            time.sleep(0.3)
            assert wait_for(lambda: not grpc_health.check(stub.address), 5)    # NOT_SERVING while draining
            with pytest.raises(grpc.RpcError) as err:
                collect(stub, submit_request(CASE["prompt_tokens"], 2), timeout=10)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert events[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert sum(len(ev.tokens) for ev in events) == 12
    assert procs["scheduler"].wait(15) == 0


def test_sixteen_concurrent_clients_get_their_solo_tokens(stack):
    """Real concurrency: 16 client threads submit fixture prompts of different lengths at random
    moments; each gets exactly the greedy tokens it gets alone."""
    import random
    prompts = [c["prompt_tokens"] for c in FIXTURE["generate"] if len(c["prompt_tokens"]) < 200]
    prompts += [t["tokens_add_special"] for t in FIXTURE["tokenize"] if len(t["tokens_add_special"]) >= 5]
    rng = random.Random(16)
    jobs = [(p, rng.randint(3, 12), rng.uniform(0, 1.5)) for p in prompts[:16]]
    assert len(jobs) == 16
    solo = [collect(stack, submit_request(p, n, ignore_eos=True))[0] for p, n, _ in jobs]
    results: dict[int, list[int]] = {}

    def client(i):
        p, n, delay = jobs[i]
        time.sleep(delay)
        results[i] = collect(stack, submit_request(p, n, request_id=f"c16-{i}", ignore_eos=True))[0]
    threads = [threading.Thread(target=client, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(200)
    assert [results.get(i) for i in range(16)] == solo


def test_kv_exhaustion_preempts_and_output_is_unchanged(stack):
    # 182 blocks of 16 tokens (64 MiB of f16 K/V): three 940-token prompts growing by 30 tokens (61
    # blocks each) cannot all fit; they differ from their first token on, so the prefix cache cannot
    # share any of their blocks. Speculation is off for these requests (`speculative: false`): with the
    # scheduler's default n-gram drafts, accepted at different rates on this repetitive text, the run
    # often ended without a preemption (about one module run in two failed here, none of 8 since)
    text = ((CASE["prompt_tokens"] + CASE["greedy_continuation"]) * 50)[:939]
    prompts = [[100 + i] + text for i in range(3)]

    def request(i: int, **kw) -> scheduler_pb2.SubmitRequest:
        r = submit_request(prompts[i], 30, ignore_eos=True, **kw)
        r.speculative = False
        return r
    solos = [collect(stack, request(i))[0] for i in range(3)]
    results: dict[int, list[int]] = {}

    def run(i):
        results[i] = collect(stack, request(i, request_id=f"p{i}"))[0]
    threads = [threading.Thread(target=run, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(200)
    assert [results.get(i) for i in range(3)] == solos
    assert "preempted sequence" in stack.log_path.read_text()
    s = stack.Stats(scheduler_pb2.StatsRequest())
    assert s.kv_blocks_free == s.kv_blocks_total and s.running == s.waiting == s.preempted == 0


def test_engine_preemption_with_a_fake_worker():
    """The engine alone: a pool too small for all sequences preempts, recomputes, and every
    sequence gets the tokens it gets alone, with no block leaked."""
    from scheduler.engine import Engine
    from scheduler.sequence import Sequence
    from shared.sampling_params import SamplingParams
    from shared.step import SeqResult, StepResult

    def executor(req):   # next token = f(all tokens so far): checks recompute feeds the right context
        seen = executor.seen
        out = []
        for c in req.chunks:
            toks = seen.setdefault(c.seq_id, [])
            del toks[c.start_pos:]
            toks.extend(int(t) for t in c.token_ids)
            assert len(c.block_table) * 4 >= len(toks)
            out.append(SeqResult(c.seq_id, token_id=(sum(toks) * 31 + len(toks)) % 1000 if c.sample else -1))
        return StepResult(out, sum(len(c.token_ids) for c in req.chunks))
    executor.seen = {}

    def run(num_blocks, prompts):
        engine = Engine(executor, num_blocks=num_blocks, block_size=4, max_context=64, max_num_batched_tokens=16)
        seqs = [Sequence(list(p), SamplingParams(max_tokens=20, temperature=0.0)) for p in prompts]
        for s in seqs:
            engine.add(s)
        while engine.has_work():
            engine.step()
        assert engine.blocks.num_free == num_blocks
        return [s.output for s in seqs], engine.num_preemptions

    prompts = [list(range(i, i + 10 + 3 * i)) for i in range(5)]
    alone = [run(64, [p])[0][0] for p in prompts]
    out, preemptions = run(16, prompts)
    assert preemptions > 0
    assert out == alone


def test_several_decode_steps_a_worker_call_over_grpc(tmp_path):
    """A scheduler with --num-decode-steps 4 against its own worker: greedy streams continue as
    llama.cpp does, events carry up to 4 tokens, a stop token inside a call ends the stream there,
    and concurrent requests get the tokens they get alone."""
    worker, worker_addr = start_worker(tmp_path, "worker")
    sched, addr = start_scheduler(tmp_path, "scheduler", "--worker", worker_addr, "--num-decode-steps", "4")
    channel = grpc.insecure_channel(addr)
    try:
        stub = scheduler_pb2_grpc.SchedulerStub(channel)
        assert wait_for(lambda: stub.Stats(scheduler_pb2.StatsRequest()).status == SERVING, 30)
        tokens, last, events = collect(stub, submit_request(CASE["prompt_tokens"], 12, ignore_eos=True))
        n = greedy_prefix_to_check(CASE)
        assert tokens[:n] == CASE["greedy_continuation"][:n] and len(tokens) == 12
        assert last.finish_reason == common_pb2.FINISH_REASON_LENGTH and last.usage.completion_tokens == 12
        assert max(len(ev.tokens) for ev in events) == 4

        stop_token = next(t for i, t in enumerate(tokens) if i >= 2 and t not in tokens[:i])
        stopped, last, _ = collect(stub, submit_request(CASE["prompt_tokens"], 12, stop_token_ids=[stop_token]))
        assert stopped == tokens[:tokens.index(stop_token) + 1]
        assert last.finish_reason == common_pb2.FINISH_REASON_STOP

        prompts = [CASE["prompt_tokens"], [1, 2, 3, 4, 5, 6, 7], list(range(100, 140))]
        solo = [collect(stub, submit_request(p, 9, ignore_eos=True))[0] for p in prompts]
        results: dict[int, list[int]] = {}

        def client(i):
            results[i] = collect(stub, submit_request(prompts[i], 9, request_id=f"k4-{i}", ignore_eos=True))[0]
        threads = [threading.Thread(target=client, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(200)
        assert [results.get(i) for i in range(3)] == solo
    finally:
        channel.close()
        stop(sched)
        stop(worker)
