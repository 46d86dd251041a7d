"""Subprocess helpers shared by the process tests: start a server, wait for its ready file, stop it.

Every server (worker, scheduler, router, `tensorserve serve`) takes ``--ready-file PATH`` and writes a
JSON object there once it listens; these helpers start one with its output in a log file, wait for
that file while checking the process is still alive (its log in the error when it is not), and stop
it with SIGTERM, then SIGKILL after a timeout.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Callable, Iterable, TypeVar

REPO = Path(__file__).resolve().parent.parent
T = TypeVar("T")


class NotReady(RuntimeError):
    """A process exited, or wrote no ready file in time; the message ends with its log."""


def spawn(cmd: list[str], log: Path, *, cwd: Path = REPO, env: dict[str, str] | None = None,
          **popen) -> subprocess.Popen:
    """Start `cmd` with stdout and stderr going to `log`; `env` is the whole environment (None: inherit)."""
    with open(log, "wb") as out:
        return subprocess.Popen(cmd, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT, **popen)


def start_with_ready_file(cmd: list[str], ready: Path, log: Path, timeout: float = 60.0,
                          env: dict[str, str] | None = None, *, name: str | None = None,
                          cwd: Path = REPO, log_chars: int | None = None,
                          interval: float = 0.05) -> tuple[subprocess.Popen, dict]:
    """Start `cmd` (which must be told ``--ready-file ready``) and return it with the ready file's JSON.

    `env` adds to this process's environment. Raises NotReady, with the log (its last `log_chars`
    characters, or all of it), when the process exits first or `timeout` seconds pass; the process
    is stopped before that.
    """
    name = name or log.stem
    ready.unlink(missing_ok=True)
    proc = spawn(cmd, log, cwd=cwd, env={**os.environ, **env} if env else None)
    deadline = time.monotonic() + timeout
    try:
        while True:
            if ready.exists():
                try:
                    return proc, json.loads(ready.read_text())
                except json.JSONDecodeError:      # being written
                    pass
            if proc.poll() is not None:
                raise NotReady(f"{name} exited with {proc.returncode} before it was ready")
            if time.monotonic() > deadline:
                raise NotReady(f"{name} not ready after {timeout:.0f}s")
            time.sleep(interval)
    except NotReady as exc:
        stop(proc)
        text = log.read_text(errors="replace")
        raise NotReady(f"{exc}; log {log}:\n{text[-log_chars:] if log_chars else text}") from None


def stop_all(procs: Iterable[subprocess.Popen], timeout: float = 15.0) -> list[int | None]:
    """SIGTERM each running process, then wait for all within `timeout` seconds together; SIGKILL the
    ones still running then. Returns their exit codes, None for each that needed SIGKILL."""
    procs = list(procs)
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout
    codes: list[int | None] = []
    for proc in procs:
        try:
            codes.append(proc.wait(max(0.1, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGUSR1)      # its threads' stacks into its log (shared/common_config.py)
            time.sleep(0.5)
            proc.kill()
            proc.wait()
            codes.append(None)
    return codes


def stop(proc: subprocess.Popen, timeout: float = 15.0) -> int | None:
    """SIGTERM (if still running), then SIGKILL after `timeout` s: the exit code, None if it needed SIGKILL."""
    return stop_all([proc], timeout)[0]


def pid_alive(pid: int) -> bool:
    """Whether `pid` is a running process (a zombie is not)."""
    try:
        os.kill(pid, 0)
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except (ProcessLookupError, FileNotFoundError):
        return False


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listened on a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(predicate: Callable[[], T], timeout: float = 10.0, interval: float = 0.05) -> T:
    """Call `predicate` until it returns something truthy or `timeout` s pass; its last value."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(interval)
