"""`tensorserve serve`: worker, scheduler and router as child processes on localhost.

Every option of the three processes that a user sets is a flag (and TS_* variable and --config
key) here; serve hands each to the process that uses it and sets the rest itself.

Internal ports are chosen free (each child reports its address in a ready
file); the public ones are the router's --http-port and --grpc-port. SIGTERM
or Ctrl-C stops the router first (it finishes in-flight requests within the
grace period), then the scheduler, then the worker. A child that dies is
reported, not hidden: the router's /health turns 503 and requests get a 503
with the reason; if the router itself dies, serve stops everything.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from router import config as router_config
from router.config import RouterConfig
from scheduler.config import SchedulerConfig
from shared.common_config import LoggingOptions, configure
from shared.options import Number, Resolved, Text, add_flags, option, options_of, product_variables, to_argv
from worker import config as worker_config
from worker.config import WorkerConfig

log = logging.getLogger("tensorserve.serve")


@dataclass(frozen=True, kw_only=True)
class ServeOptions(LoggingOptions):
    ready_file: str | None = option(None, "write the public addresses and the children's pids as JSON here "
                                    "once serving", Text(metavar="FILE"), env="TS_READY_FILE")
    start_timeout: float = option(600.0, "seconds each child process may take to start (the first start "
                                  "compiles the kernels)", Number(0, exclusive=True), env="TS_START_TIMEOUT")


# every user-facing option of the three processes, each once; serve assigns the internal ones
OPTIONS = options_of(RouterConfig, WorkerConfig, SchedulerConfig, ServeOptions, include_internal=False)
CHILD_OPTIONS = {"worker": options_of(WorkerConfig), "scheduler": options_of(SchedulerConfig),
                 "router": options_of(RouterConfig)}


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_flags(p, OPTIONS)


def _check(resolved: Resolved) -> None:
    worker_config.check(resolved)
    router_config.check(resolved)


def _child_environment() -> dict[str, str]:
    """This environment less the product's variables: a child takes its options from serve alone."""
    product = {e for options in CHILD_OPTIONS.values() for e in product_variables(options)}
    return {k: v for k, v in os.environ.items() if k not in product}


class Child:
    def __init__(self, name: str, config: Any, ready_dir: Path, start_timeout: float):
        self.name = name
        self.ready = ready_dir / f"{name}.json"
        self.start_timeout = start_timeout
        args, secrets = to_argv(CHILD_OPTIONS[name], dataclasses.replace(config, ready_file=str(self.ready)))
        cmd = [sys.executable, "-m", f"{name}.main", *args]
        log.info("starting %s: %s", name, " ".join(cmd))
        self.proc = subprocess.Popen(cmd, env={**_child_environment(), **secrets})

    def wait_ready(self, others: list["Child"]) -> dict:
        deadline = time.monotonic() + self.start_timeout
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
        raise RuntimeError(f"{self.name} did not become ready within {self.start_timeout:.0f} s "
                           "(--start-timeout)")

    def stop(self, grace: float) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                log.warning("%s did not stop within %.0f s; killing it", self.name, grace)
                self.proc.kill()
                self.proc.wait()


def run(flags: argparse.Namespace) -> int:
    configured = configure("serve", ServeOptions, flags, check=_check, options=OPTIONS)
    if isinstance(configured, int):
        return configured
    args, resolved = configured
    token = secrets.token_hex(16)        # the children's internal token: only they know it
    worker_cfg = resolved.build(WorkerConfig, host="127.0.0.1", port=0, internal_token=token)
    scheduler_cfg = resolved.build(SchedulerConfig, host="127.0.0.1", port=0, internal_token=token)
    router_cfg = resolved.build(RouterConfig, internal_token=token)
    stop = {"signal": None}

    def on_signal(signum, frame):
        stop["signal"] = signum
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)

    children: list[Child] = []
    with tempfile.TemporaryDirectory(prefix="tensorserve-") as tmp:
        ready_dir = Path(tmp)
        try:
            worker = Child("worker", worker_cfg, ready_dir, args.start_timeout)
            children.append(worker)
            worker_addr = worker.wait_ready([])["address"]
            scheduler = Child("scheduler", dataclasses.replace(scheduler_cfg, worker=worker_addr), ready_dir,
                              args.start_timeout)
            children.append(scheduler)
            scheduler_addr = scheduler.wait_ready([worker])["address"]
            router = Child("router", dataclasses.replace(router_cfg, scheduler=scheduler_addr), ready_dir,
                           args.start_timeout)
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
        print(f"TensorServe is serving {router_cfg.model}: OpenAI API at http://{public['http']}/v1, "
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
            c.stop(router_cfg.grace_period + 5)
        return 0 if stop["signal"] is not None else 1
