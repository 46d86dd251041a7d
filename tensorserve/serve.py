"""`tensorserve serve`: worker, scheduler and router as child processes on localhost.

Every option of the three processes that a user sets is a flag (and TS_* variable and --config
key) here; serve hands each to the process that uses it and sets the rest itself.

Internal ports are chosen free (each child reports its address in a ready
file); the public ones are the router's --http-port and --grpc-port. SIGTERM
or Ctrl-C stops the router first (it finishes in-flight requests within the
grace period), then the scheduler, then the worker. A child that dies is
restarted after a backoff (tensorserve/supervisor.py); meanwhile the router's /health turns 503 and
requests get a 503 naming it. If the router itself dies, serve stops everything.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import secrets
import signal
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from router import config as router_config
from router.config import RouterConfig
from scheduler.config import SchedulerConfig, check_speculative
from shared.common_config import LoggingOptions, configure
from shared.option_kinds import Number, Text
from shared.options import Resolved, add_flags, environment_without, option, options_of
from tensorserve.supervisor import Child, free_port, write_status
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
    check_speculative(resolved)


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
        status_path = ready_dir / "supervisor.json"
        environment = environment_without(o for options in CHILD_OPTIONS.values() for o in options)

        def child(name: str, config: Any) -> Child:
            c = Child(name, CHILD_OPTIONS[name], config, ready_dir, args.start_timeout, environment)
            children.append(c)
            return c
        try:
            # fixed ports: a restarted worker or scheduler comes back where its client dials
            worker = child("worker", dataclasses.replace(worker_cfg, port=free_port()))
            worker_addr = worker.wait_ready([])["address"]
            scheduler = child("scheduler", dataclasses.replace(scheduler_cfg, worker=worker_addr, port=free_port()))
            scheduler_addr = scheduler.wait_ready([worker])["address"]
            write_status(status_path, children)
            router = child("router", dataclasses.replace(router_cfg, scheduler=scheduler_addr,
                                                         supervisor_status=str(status_path)))
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

        written = write_status(status_path, children)
        while stop["signal"] is None and router.alive:
            for c in (worker, scheduler):
                c.supervise(time.monotonic())
            written = write_status(status_path, children, unless=written)
            time.sleep(0.1)
        if not router.alive:
            print(f"tensorserve: the router exited with status {router.proc.returncode}; stopping.", file=sys.stderr,
                  flush=True)

        for c in reversed(children):      # router first: it drains in-flight requests
            c.stop(router_cfg.grace_period + 5)
        return 0 if stop["signal"] is not None else 1
