"""`tensorserve serve`'s children, and their supervision: a worker or scheduler that dies is
started again on the same address (so the scheduler re-dials its worker and the router its
scheduler with nothing to reconfigure), after a backoff that doubles with each failure in a
row; the restart counts and states are written as JSON for the router's /metrics and /health.
The router is not restarted: when it dies, serve stops, for the supervisor above it (systemd,
compose) to start again.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from shared.options import Option, to_argv

log = logging.getLogger("tensorserve.serve")

BACKOFF_START_S, BACKOFF_MAX_S = 0.5, 30.0
HEALTHY_AFTER_S = 60.0          # up this long, a child's next failure starts the backoff again


def free_port(host: str = "127.0.0.1") -> int:
    """A port free now, kept by a child across its restarts."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class Child:
    """One child process: `python -m <name>.main` with its configuration as flags, secrets in its
    environment, and none of the product's variables (its configuration is serve's alone)."""

    def __init__(self, name: str, options: list[Option], config: Any, ready_dir: Path, start_timeout: float,
                 environment: dict[str, str], label: str | None = None):
        self.name = name                # the process package: router, scheduler or worker
        self.label = label or name      # how it is named in messages and the status ('worker/<model>/<replica>')
        self.ready = ready_dir / (self.label.replace("/", "_") + ".json")
        self.start_timeout = start_timeout
        self.config = dataclasses.replace(config, ready_file=str(self.ready))
        self.args, secrets = to_argv(options, self.config)
        self.environment = {**environment, **secrets}
        self.proc: subprocess.Popen | None = None
        self.started_at = 0.0
        self.restarts = 0
        self.failures_in_a_row = 0
        self.restart_at: float | None = None      # set while it waits out its backoff
        self.last_exit: int | None = None
        self.start()

    def start(self) -> None:
        self.ready.unlink(missing_ok=True)
        cmd = [sys.executable, "-m", f"{self.name}.main", *self.args]
        log.info("starting %s: %s", self.label, " ".join(cmd))
        self.proc = subprocess.Popen(cmd, env=self.environment)
        self.started_at = time.monotonic()

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def state(self) -> str:
        if self.alive:
            return "running" if self.ready.exists() else "starting"
        return "restarting" if self.restart_at is not None else "exited"

    def wait_ready(self, others: list["Child"]) -> dict:
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            if self.ready.exists():
                try:
                    return json.loads(self.ready.read_text())
                except json.JSONDecodeError:
                    pass            # being written
            for c in [self, *others]:
                if not c.alive:
                    raise RuntimeError(f"{c.label} exited with status {c.proc.returncode} while starting; "
                                       "see its messages above")
            time.sleep(0.1)
        raise RuntimeError(f"{self.label} did not become ready within {self.start_timeout:.0f} s (--start-timeout)")

    def stop(self, grace: float) -> None:
        self.restart_at = None
        if self.alive:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                log.warning("%s did not stop within %.0f s; killing it", self.label, grace)
                self.proc.kill()
                self.proc.wait()

    def supervise(self, now: float) -> None:
        """Notes a death and restarts the child once its backoff is over."""
        if self.alive:
            return
        if self.restart_at is None:
            self.last_exit = self.proc.returncode
            up = now - self.started_at
            self.failures_in_a_row = 1 if up > HEALTHY_AFTER_S else self.failures_in_a_row + 1
            delay = min(BACKOFF_MAX_S, BACKOFF_START_S * 2 ** (self.failures_in_a_row - 1))
            self.restart_at = now + delay
            print(f"tensorserve: {self.label} exited with status {self.last_exit} after {up:.0f} s; restarting it "
                  f"in {delay:g} s (restart {self.restarts + 1}); requests meanwhile get 503", file=sys.stderr,
                  flush=True)
        elif now >= self.restart_at:
            self.restart_at = None
            self.restarts += 1
            self.start()

    def status(self) -> dict:
        return {"state": self.state, "pid": self.proc.pid if self.proc else None, "restarts": self.restarts,
                "last_exit": self.last_exit}


def write_status(path: Path, children: list[Child], unless: dict | None = None) -> dict:
    """The children's states and restart counts, for the router (--supervisor-status); written
    only when they differ from `unless` (what was written last). Returns them."""
    status = {c.label: c.status() for c in children}
    if status != unless:
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(status))
        tmp.replace(path)
    return status
