"""Work whose client has left stops: a client that disconnects while its 7000-token prompt is
being prefilled (HTTP streamed or not, or a cancelled gRPC call) aborts the sequence at the next
step boundary, mid-prefill, and frees its blocks. Shown with the worker's computed-token count
(the scheduler's Stats, as the router's /metrics exports it)."""
from __future__ import annotations

import re
import sys
import time

import grpc
import httpx
import pytest

from processes import start_with_ready_file, stop, wait_for
from protos.tensorserve.v1 import common_pb2, router_pb2, router_pb2_grpc

# 7000 token ids (no prefix-cache hits between cases): a prompt no CPU prefills in the 2 s before its
# client leaves (SmolLM2 prefills ~1000-2000 tok/s at short depth on 2 cores, slower as it grows)
PROMPT = [(i * 7919) % 40000 + 100 for i in range(7000)]
STOPPED_BY = 5000


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("disconnect")
    ready = tmp / "serve.json"
    proc, info = start_with_ready_file([sys.executable, "-m", "tensorserve", "serve", "--http-port", "0",
                                        "--grpc-port", "0", "--kv-memory", "256MiB", "--no-enable-prefix-caching",
                                        "--ready-file", str(ready)], ready, tmp / "serve.log", timeout=300)
    yield info
    assert stop(proc, timeout=30) == 0


def metric(info: dict, name: str) -> float:
    text = httpx.get(f"http://{info['http']}/metrics", timeout=10).text
    m = re.search(rf"^{name} ([0-9.e+]+)$", text, re.M)
    assert m, f"{name} not in /metrics"
    return float(m.group(1))


def computed(info: dict) -> float:
    httpx.get(f"http://{info['http']}/health", timeout=10)          # refreshes the scheduler's stats
    return metric(info, "tensorserve_tokens_computed_total")


def settle(info: dict) -> float:
    """The count once it stops growing, and every block back in the pool."""
    last = computed(info)
    while True:
        time.sleep(1.0)
        now = computed(info)
        if now == last:
            break
        last = now
    assert wait_for(lambda: metric(info, "tensorserve_kv_blocks_free") == metric(info, "tensorserve_kv_blocks_total")
                    and metric(info, "tensorserve_num_requests_running") == 0, 10)
    return now


def http_client_leaves(info: dict, stream: bool) -> None:
    body = {"model": "smollm2-135m", "prompt": PROMPT, "max_tokens": 200, "stream": stream}
    with pytest.raises(httpx.ReadTimeout):
        if stream:
            with httpx.stream("POST", f"http://{info['http']}/v1/completions", json=body, timeout=2.0) as r:
                for _ in r.iter_bytes():
                    pass
        else:
            httpx.post(f"http://{info['http']}/v1/completions", json=body, timeout=2.0)


def grpc_client_cancels(info: dict) -> None:
    with grpc.insecure_channel(info["grpc"]) as channel:
        call = router_pb2_grpc.GenerationStub(channel).Generate(router_pb2.GenerateRequest(
            model="smollm2-135m", token_ids=router_pb2.TokenIds(ids=PROMPT),
            sampling=common_pb2.SamplingParams(max_tokens=200)), timeout=60)
        time.sleep(2.0)
        call.cancel()


@pytest.mark.parametrize("leave", [lambda i: http_client_leaves(i, False), lambda i: http_client_leaves(i, True),
                                   grpc_client_cancels], ids=["http", "http-streamed", "grpc-cancel"])
def test_a_client_that_leaves_mid_prefill_stops_its_work(served, leave):
    before = settle(served)
    t0 = time.monotonic()
    leave(served)
    left_at = time.monotonic() - t0
    spent = settle(served) - before
    print(f"\ncomputed {spent:.0f} of the prompt's {len(PROMPT)} tokens after the client left at {left_at:.1f} s")
    assert 0 < spent < STOPPED_BY, f"{spent} tokens computed: the prefill went on after the client left"
