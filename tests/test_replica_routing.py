"""Two replicas of one model behind one router (`tensorserve serve --replicas 2`), each worker's KV
pool holding about half of the workload's system prompts: prefix-aware routing sends a request to
the replica that holds its system prompt (>= 90 % prefix hits, measured by the schedulers'
cached_tokens), round-robin does not; a killed replica's requests go to the other at once, and the
restarted replica takes requests again. The workload is loadtest/bench_routing.py's."""
from __future__ import annotations

import asyncio
import importlib.util
import os
import re
import signal
import sys
import time
from pathlib import Path

import httpx
import pytest

from processes import start_with_ready_file, stop, wait_for

_spec = importlib.util.spec_from_file_location(
    "bench_routing", Path(__file__).resolve().parents[1] / "loadtest" / "bench_routing.py")
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)

MODEL = "smollm2-135m"
WORKLOAD = bench.workload(prompts=4, per_prompt=20, words=150, seed=0)


def _serve(tmp: Path, routing: str) -> tuple:
    ready = tmp / f"{routing}.json"
    cmd = [sys.executable, "-m", "tensorserve", "serve", "--replicas", "2", "--routing", routing,
           "--kv-memory", "16MiB", "--no-prefix-checkpoints", "--speculative", "off", "--grace-period", "5",
           "--unavailable-timeout", "60", "--http-port", "0", "--grpc-port", "0", "--ready-file", str(ready)]
    proc, info = start_with_ready_file(cmd, ready, tmp / f"{routing}.log", timeout=300, name="serve")
    info["base"] = f"http://{info['http']}"
    return proc, info


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    proc, info = _serve(tmp_path_factory.mktemp("replicas"), "prefix-aware")
    yield info
    assert stop(proc, timeout=60) == 0


def _routed(info: dict, replica: int) -> float:
    text = httpx.get(info["base"] + "/metrics", timeout=10).text
    return sum(float(v) for v in re.findall(
        rf'^tensorserve_routed_requests_total{{model="{MODEL}",prefix="\w+",replica="{replica}"}} ([0-9.]+)$',
        text, re.M))


def test_prefix_aware_routing_hits_the_shared_system_prompt(served):
    result = asyncio.run(bench.run_workload(served["base"], MODEL, WORKLOAD, concurrency=2))
    print(f"\nprefix-aware, 2 replicas: {result['hits']}/{result['requests']} requests hit a cached prefix "
          f"({result['hit_rate']:.0%}), {result['cached_token_fraction']:.0%} of prompt tokens cached; "
          f"routed {result['routed']}")
    assert result["hit_rate"] >= 0.9, result
    assert _routed(served, 0) > 0 and _routed(served, 1) > 0        # both replicas took system prompts


@pytest.mark.slow       # the comparison itself is loadtest/bench_routing.py's; ~40 s of CI
def test_round_robin_misses_where_prefix_aware_hits(tmp_path):
    proc, info = _serve(tmp_path, "round-robin")
    try:
        result = asyncio.run(bench.run_workload(info["base"], MODEL, WORKLOAD, concurrency=2))
    finally:
        stop(proc, timeout=60)
    print(f"\nround-robin, 2 replicas: {result['hits']}/{result['requests']} requests hit a cached prefix "
          f"({result['hit_rate']:.0%}), {result['cached_token_fraction']:.0%} of prompt tokens cached")
    assert result["hit_rate"] < 0.85, result


def _complete(info: dict, prompt: str) -> httpx.Response:
    return httpx.post(info["base"] + "/v1/completions", timeout=120,
                      json={"model": MODEL, "prompt": prompt, "max_tokens": 2, "temperature": 0})


def test_a_killed_replica_is_skipped_and_rejoins_after_its_restart(served):
    label = f"scheduler/{MODEL}/0"
    os.kill(served["pids"][label], signal.SIGKILL)
    before = _routed(served, 1)
    t0 = time.monotonic()
    for i in range(4):          # each at once on the other replica, none waiting for the restart
        response = _complete(served, f"Replica failover {i}: once upon a time")
        assert response.status_code == 200, response.text
    elapsed = time.monotonic() - t0
    assert _routed(served, 1) == before + 4
    assert elapsed < 10, f"requests took {elapsed:.1f} s while replica 0 was down"

    def rejoined() -> bool:
        health = httpx.get(served["base"] + "/health", timeout=10).json()
        mine = [c for c in health["components"] if c.get("replica") == 0 and c["name"] == "scheduler"]
        return bool(mine) and mine[0].get("process") == "running" and mine[0]["status"] == "ok" \
            and mine[0]["restarts"] == 1
    assert wait_for(rejoined, timeout=120, interval=0.5), "the killed scheduler did not come back"
    # a new prompt is a miss everywhere: it goes to the least loaded, emptiest cache, the restarted one
    before = _routed(served, 0)
    assert wait_for(lambda: _complete(served, "A new story after the restart:").status_code == 200
                    and _routed(served, 0) > before, timeout=30, interval=0.5)
