"""`tensorserve serve`: worker, scheduler and router as child processes on localhost.

Internal ports are chosen free (each child reports its address in a ready
file); the public ones are the router's --http-port and --grpc-port. SIGTERM
or Ctrl-C stops the router first (it finishes in-flight requests within the
grace period), then the scheduler, then the worker. A child that dies is
reported, not hidden: the router's /health turns 503 and requests get a 503
with the reason; if the router itself dies, serve stops everything.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

log = logging.getLogger("tensorserve.serve")

START_TIMEOUT_S = float(os.environ.get("TS_START_TIMEOUT", "600"))


def add_arguments(p: argparse.ArgumentParser) -> None:
    env = os.environ.get
    p.add_argument("--model", "-m", default=env("TS_MODEL", "smollm2-135m"),
                   help="bundled model name or GGUF path [env TS_MODEL, default smollm2-135m]")
    p.add_argument("--host", default=env("TS_ROUTER_HOST", "127.0.0.1"),
                   help="address the public APIs listen on [env TS_ROUTER_HOST, default 127.0.0.1]")
    p.add_argument("--http-port", type=int, default=int(env("TS_HTTP_PORT", "8000")),
                   help="OpenAI-compatible HTTP port [env TS_HTTP_PORT, default 8000]")
    p.add_argument("--grpc-port", type=int, default=int(env("TS_GRPC_PORT", "50051")),
                   help="gRPC Generation port [env TS_GRPC_PORT, default 50051]")
    p.add_argument("--api-key", default=env("TS_API_KEY"), help="require this key on HTTP and gRPC [env TS_API_KEY]")
    p.add_argument("--kv-memory", default=env("TS_KV_MEMORY", "512MiB"),
                   help="KV cache memory of the worker, e.g. 512MiB, 2GiB [env TS_KV_MEMORY, default 512MiB]")
    p.add_argument("--max-num-seqs", default=env("TS_MAX_NUM_SEQS", "64"),
                   help="sequences running at once [env TS_MAX_NUM_SEQS, default 64]")
    p.add_argument("--max-num-batched-tokens", default=env("TS_MAX_NUM_BATCHED_TOKENS", "256"),
                   help="tokens computed per engine step at most (prefill chunk budget) "
                        "[env TS_MAX_NUM_BATCHED_TOKENS, default 256]")
    p.add_argument("--max-prefill-tokens-while-decoding",
                   default=env("TS_MAX_PREFILL_TOKENS_WHILE_DECODING", "48"),
                   help="prompt tokens a step that also decodes takes at most: bounds the running "
                        "requests' inter-token latency while new prompts arrive "
                        "[env TS_MAX_PREFILL_TOKENS_WHILE_DECODING, default 48]")
    p.add_argument("--num-decode-steps", default=env("TS_NUM_DECODE_STEPS", "1"),
                   help="tokens a step that only decodes computes in one worker call (multi-step "
                        "scheduling): less host work a token, tokens streamed that many at a time "
                        "[env TS_NUM_DECODE_STEPS, default 1]")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                   default=env("TS_ENABLE_PREFIX_CACHING", "1") not in ("0", "false", "no"),
                   help="reuse the KV of full blocks shared with earlier prompts [env TS_ENABLE_PREFIX_CACHING, "
                        "default on]")
    p.add_argument("--grace-period", type=float, default=float(env("TS_GRACE_PERIOD", "10")),
                   help="seconds in-flight requests get to finish on shutdown [env TS_GRACE_PERIOD, default 10]")
    p.add_argument("--ready-file", default=env("TS_READY_FILE"),
                   help="write the public addresses and child pids as JSON here once serving")


class Child:
    def __init__(self, name: str, args: list[str], ready_dir: Path):
        self.name = name
        self.ready = ready_dir / f"{name}.json"
        cmd = [sys.executable, "-m", f"{name}.main", *args, "--ready-file", str(self.ready)]
        log.info("starting %s: %s", name, " ".join(cmd))
        self.proc = subprocess.Popen(cmd)

    def wait_ready(self, others: list["Child"]) -> dict:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.ready.exists():
                try:
                    return json.loads(self.ready.read_text())
                except json.JSONDecodeError:
                    pass            # being written
            for c in [self, *others]:
                if c.proc.poll() is not None:
                    raise RuntimeError(f"{c.name} exited with status {c.proc.returncode} while starting; "
                                       "see its messages above")
            time.sleep(0.1)
        raise RuntimeError(f"{self.name} did not become ready within {START_TIMEOUT_S:.0f} s")

    def stop(self, grace: float) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                log.warning("%s did not stop within %.0f s; killing it", self.name, grace)
                self.proc.kill()
                self.proc.wait()


def run(args: argparse.Namespace) -> int:
    stop = {"signal": None}

    def on_signal(signum, frame):
        stop["signal"] = signum
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)

    children: list[Child] = []
    with tempfile.TemporaryDirectory(prefix="tensorserve-") as tmp:
        ready_dir = Path(tmp)
        try:
            worker = Child("worker", ["--model", args.model, "--port", "0", "--kv-memory", str(args.kv_memory)],
                           ready_dir)
            children.append(worker)
            worker_addr = worker.wait_ready([])["address"]
            scheduler = Child("scheduler", ["--worker", worker_addr, "--port", "0",
                                            "--max-num-seqs", str(args.max_num_seqs),
                                            "--max-num-batched-tokens", str(args.max_num_batched_tokens),
                                            "--max-prefill-tokens-while-decoding",
                                            str(args.max_prefill_tokens_while_decoding),
                                            "--num-decode-steps", str(args.num_decode_steps),
                                            "--enable-prefix-caching" if args.enable_prefix_caching
                                            else "--no-enable-prefix-caching",
                                            "--grace-period", str(args.grace_period)], ready_dir)
            children.append(scheduler)
            scheduler_addr = scheduler.wait_ready([worker])["address"]
            router_args = ["--model", args.model, "--scheduler", scheduler_addr, "--host", args.host,
                           "--http-port", str(args.http_port), "--grpc-port", str(args.grpc_port),
                           "--grace-period", str(args.grace_period)]
            if args.api_key:
                router_args += ["--api-key", args.api_key]
            router = Child("router", router_args, ready_dir)
            children.append(router)
            public = router.wait_ready([worker, scheduler])
        except RuntimeError as exc:
            print(f"error: {exc}", file=sys.stderr)
            for c in reversed(children):
                c.stop(2.0)
            return 1

        info = {**public, "pids": {c.name: c.proc.pid for c in children}}
        if args.ready_file:
            Path(args.ready_file).write_text(json.dumps(info))
        print(f"TensorServe is serving {args.model}: OpenAI API at http://{public['http']}/v1, "
              f"gRPC Generation at {public['grpc']}", flush=True)

        reported: set[str] = set()
        while stop["signal"] is None:
            for c in children:
                if c.proc.poll() is not None and c.name not in reported:
                    reported.add(c.name)
                    log.error("%s exited with status %s", c.name, c.proc.returncode)
                    print(f"tensorserve: {c.name} exited with status {c.proc.returncode}; "
                          + ("stopping." if c is router else "/health reports it and requests get 503."),
                          file=sys.stderr, flush=True)
            if router.proc.poll() is not None:
                break
            time.sleep(0.2)

        for c in reversed(children):      # router first: it drains in-flight requests
            c.stop(args.grace_period + 5)
        return 0 if stop["signal"] is not None else 1
