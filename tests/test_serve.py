"""`tensorserve serve`: the three processes together, as a user starts them."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import httpx
import openai
import pytest

from conftest import load_fixture
from processes import pid_alive, start_with_ready_file, stop, wait_for
from shared import grpc_health
from protos.tensorserve.v1 import common_pb2, router_pb2, router_pb2_grpc
from shared.sampling_params import SamplingParams

START_TIMEOUT = 180


def start_serve(tmp_path: Path, name: str) -> tuple[subprocess.Popen, dict]:
    ready = tmp_path / f"{name}.json"
    return start_with_ready_file([sys.executable, "-m", "tensorserve", "serve", "--http-port", "0", "--grpc-port",
                                  "0", "--kv-memory", "96MiB", "--grace-period", "5", "--ready-file", str(ready)],
                                 ready, tmp_path / f"{name}.log", timeout=START_TIMEOUT, name="serve")


def stop_serve(proc: subprocess.Popen) -> int | None:
    return stop(proc, timeout=60)


class SharedStack:
    """One `tensorserve serve` for the module's tests; the SIGTERM test (the module's last) stops
    it, and a test after that, or run alone, gets a new one."""

    def __init__(self, tmp: Path):
        self.tmp, self.proc, self.info, self.starts = tmp, None, None, 0

    def get(self) -> dict:
        if self.proc is None or self.proc.poll() is not None:
            self.starts += 1
            self.proc, self.info = start_serve(self.tmp, f"serve-{self.starts}")
        return self.info


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    shared = SharedStack(tmp_path_factory.mktemp("serve"))
    yield shared
    if shared.proc is not None:
        stop_serve(shared.proc)


@pytest.fixture
def served(stack):
    return stack.get()


def test_greedy_through_the_stack_equals_in_process_generation(served, engines):
    case = load_fixture("smollm2-135m")["generate"][1]
    n = 24
    expected = engines("smollm2-135m").generate(
        [case["prompt_tokens"]], SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))[0].tokens
    channel = grpc.insecure_channel(served["grpc"])
    stub = router_pb2_grpc.GenerationStub(channel)
    request = router_pb2.GenerateRequest(
        token_ids=router_pb2.TokenIds(ids=case["prompt_tokens"]),
        sampling=common_pb2.SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
    got = []
    for event in stub.Generate(request, timeout=120):
        if event.HasField("delta"):
            got.extend(event.delta.token_ids)
    assert got == expected


def test_openai_client_streams_and_completes(served):
    client = openai.OpenAI(base_url=f"http://{served['http']}/v1", api_key="unused")
    chat = client.chat.completions.create(model="smollm2-135m", max_tokens=8, temperature=0,
                                          messages=[{"role": "user", "content": "Say hello."}])
    assert chat.choices[0].message.content and chat.usage.completion_tokens <= 8
    pieces = [c.choices[0].text for c in client.completions.create(
        model="smollm2-135m", prompt="The capital of France is", max_tokens=6, temperature=0, stream=True)
        if c.choices]
    plain = client.completions.create(model="smollm2-135m", prompt="The capital of France is", max_tokens=6,
                                      temperature=0)
    assert "".join(pieces) == plain.choices[0].text
    assert "Paris" in plain.choices[0].text


def test_generation_ends_at_the_models_end_of_generation_token(served):
    """SmolLM2 answers this question in a few tokens and then samples <|im_end|>: the answer stops
    there ("stop", fewer tokens than asked for), where the same request with ignore_eos goes on."""
    client = openai.OpenAI(base_url=f"http://{served['http']}/v1", api_key="unused")
    ask = dict(model="smollm2-135m", max_tokens=40, temperature=0, logprobs=True,
               messages=[{"role": "user", "content": "What is the capital of France?"}])
    stopped = client.chat.completions.create(**ask)
    longer = client.chat.completions.create(**ask, extra_body={"ignore_eos": True})
    choice = stopped.choices[0]
    assert choice.finish_reason == "stop"
    n = stopped.usage.completion_tokens
    assert 0 < n < 40 and longer.usage.completion_tokens == 40
    tokens = [t.token for t in choice.logprobs.content]
    assert len(tokens) == n
    assert tokens == [t.token for t in longer.choices[0].logprobs.content][:n]
    assert tokens[-1] == "<|im_end|>" and "<|im_end|>" not in tokens[:-1]
    assert "<|im_end|>" not in choice.message.content


def test_dead_worker_gives_clear_errors_and_the_router_stays_up(tmp_path):
    proc, info = start_serve(tmp_path, "dying")
    try:
        base = f"http://{info['http']}"
        assert httpx.get(base + "/health", timeout=10).status_code == 200
        assert wait_for(lambda: grpc_health.check(info["grpc"]), 5)
        client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=60)
        stream = client.completions.create(model="smollm2-135m", prompt="Once upon a time", max_tokens=400,
                                           temperature=0, stream=True, extra_body={"ignore_eos": True})
        received = 0
        with pytest.raises(openai.APIError) as failure:
            for chunk in stream:
                received += 1
                if received == 3:
                    os.kill(info["pids"]["worker"], signal.SIGKILL)
        assert "worker" in str(failure.value).lower()
        deadline = time.monotonic() + 20
        while (health := httpx.get(base + "/health", timeout=10)).status_code == 200:
            assert time.monotonic() < deadline, "health still says ok after the worker died"
            time.sleep(0.2)
        assert health.status_code == 503 and "worker" in health.text.lower()
        assert wait_for(lambda: not grpc_health.check(info["grpc"]), 5)     # the standard service agrees
        # a new request waits for the restarted worker (--unavailable-timeout) instead of failing
        response = httpx.post(base + "/v1/completions", timeout=60,
                              json={"model": "smollm2-135m", "prompt": "hi", "max_tokens": 2})
        assert response.status_code == 200, response.text
        assert proc.poll() is None and pid_alive(info["pids"]["router"])
    finally:
        code = stop_serve(proc)
    assert code == 0
    for name in ("router", "scheduler"):
        assert not pid_alive(info["pids"][name]), f"{name} still running after SIGTERM"


def test_serve_children_listen_on_loopback_only(served):
    """Scheduler and worker listen on 127.0.0.1 unless told otherwise (test_internal_surface.py
    has the rest of the internal surface)."""
    from test_internal_surface import _listening, _loopback
    for name in ("worker", "scheduler"):
        addresses = _listening(served["pids"][name])
        assert addresses and all(_loopback(ip) for ip in addresses), (name, addresses)


def test_sigterm_stops_all_three_and_leaves_no_shared_memory(stack):
    """SIGTERM to the module's stack, which has served the tests above (the last test here)."""
    info = stack.get()
    client = openai.OpenAI(base_url=f"http://{info['http']}/v1", api_key="unused")
    assert client.completions.create(model="smollm2-135m", prompt="Hi", max_tokens=2).choices[0].text is not None
    assert stop_serve(stack.proc) == 0
    for name, pid in info["pids"].items():
        assert not pid_alive(pid), f"{name} still running"
        leftovers = [p.name for p in Path("/dev/shm").glob(f"ts-{pid}-*")]
        assert not leftovers, f"{name} left shared memory segments {leftovers}"
