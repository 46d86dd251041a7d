"""The internal surface: scheduler and worker listen on 127.0.0.1 unless told otherwise; told
otherwise, they refuse to start without --internal-token, and with one they refuse every call
that does not carry it (health checks stay open), so nothing reaches them around the router's
API key. /health and /metrics are open by default and behind the key with --protect-metrics."""
from __future__ import annotations

import ipaddress
import os
import subprocess
import sys
from pathlib import Path

import grpc
import httpx
import psutil
import pytest

from processes import start_with_ready_file, stop, wait_for
from protos.tensorserve.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc, worker_pb2, worker_pb2_grpc
from shared import grpc_health
from shared.grpc_auth import internal_metadata

REPO = Path(__file__).resolve().parents[1]
TOKEN = "s3cret-internal"


def _clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("TS_")}


def _loopback(ip: str) -> bool:
    address = ipaddress.ip_address(ip)
    mapped = getattr(address, "ipv4_mapped", None)        # gRPC binds 127.0.0.1 as ::ffff:127.0.0.1
    return (mapped or address).is_loopback


def _listening(pid: int) -> list[str]:
    return [c.laddr.ip for c in psutil.Process(pid).net_connections(kind="tcp") if c.status == psutil.CONN_LISTEN]


# `tensorserve serve`'s children listening on loopback only: test_serve.py, on its module's stack


@pytest.mark.parametrize("command", ["worker", "scheduler"])
def test_listening_beyond_loopback_needs_the_internal_token(command):
    out = subprocess.run([sys.executable, "-m", f"{command}.main", "--host", "0.0.0.0"], capture_output=True,
                         text=True, timeout=120, cwd=REPO, env=_clean_env())
    assert out.returncode == 2 and "--internal-token" in out.stderr and "other hosts" in out.stderr, out.stderr


@pytest.fixture(scope="module")
def guarded(tmp_path_factory):
    """A worker and a scheduler on 0.0.0.0, both with the token."""
    tmp = tmp_path_factory.mktemp("guarded")
    env = {**_clean_env(), "TS_INTERNAL_TOKEN": TOKEN}
    w_ready, s_ready = tmp / "w.json", tmp / "s.json"
    worker, w = start_with_ready_file([sys.executable, "-m", "worker.main", "--host", "0.0.0.0", "--kv-memory",
                                       "64MiB", "--ready-file", str(w_ready)], w_ready, tmp / "w.log", env=env)
    w_addr = "127.0.0.1:" + w["address"].rsplit(":", 1)[1]
    scheduler, s = start_with_ready_file([sys.executable, "-m", "scheduler.main", "--host", "0.0.0.0", "--worker",
                                          w_addr, "--ready-file", str(s_ready)], s_ready, tmp / "s.log", env=env)
    s_addr = "127.0.0.1:" + s["address"].rsplit(":", 1)[1]
    yield w_addr, s_addr
    stop(scheduler)
    stop(worker)


def test_calls_without_the_token_are_refused_and_health_stays_open(guarded):
    w_addr, s_addr = guarded
    assert wait_for(lambda: grpc_health.check(s_addr), 60)      # the scheduler reached the worker with the token
    assert grpc_health.check(w_addr)
    request = scheduler_pb2.SubmitRequest(prompt_token_ids=[1, 2, 3], sampling=common_pb2.SamplingParams(max_tokens=2))
    with grpc.insecure_channel(s_addr) as channel:
        stub = scheduler_pb2_grpc.SchedulerStub(channel)
        for metadata in ((), internal_metadata("wrong")):
            with pytest.raises(grpc.RpcError) as info:
                list(stub.Submit(request, timeout=30, metadata=metadata))
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED and "--internal-token" in info.value.details()
        with pytest.raises(grpc.RpcError) as info:
            stub.Stats(scheduler_pb2.StatsRequest(), timeout=10)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        events = list(stub.Submit(request, timeout=60, metadata=internal_metadata(TOKEN)))
        assert events[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
    with grpc.insecure_channel(w_addr) as channel:
        stub = worker_pb2_grpc.WorkerStub(channel)
        with pytest.raises(grpc.RpcError) as info:
            stub.Describe(worker_pb2.DescribeRequest(), timeout=10)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as info:      # the stream the scheduler steps through
            list(stub.StepStream(iter([worker_pb2.StepRequest()]), timeout=10))
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert stub.Describe(worker_pb2.DescribeRequest(), timeout=10, metadata=internal_metadata(TOKEN)).num_blocks


def test_protect_metrics_puts_health_and_metrics_behind_the_key(tmp_path):
    out = subprocess.run([sys.executable, "-m", "router.main", "--protect-metrics"], capture_output=True, text=True,
                         timeout=120, cwd=REPO, env=_clean_env())
    assert out.returncode == 2 and "--api-key" in out.stderr
    ready = tmp_path / "r.json"
    router, info = start_with_ready_file([sys.executable, "-m", "router.main", "--http-port", "0", "--grpc-port", "0",
                                          "--api-key", "k", "--protect-metrics", "--ready-file", str(ready)],
                                         ready, tmp_path / "r.log", env=_clean_env())
    try:
        base = f"http://{info['http']}"
        for path in ("/health", "/metrics"):
            assert httpx.get(base + path, timeout=10).status_code == 401
            assert httpx.get(base + path, timeout=10, headers={"Authorization": "Bearer k"}).status_code in (200, 503)
    finally:
        stop(router)
