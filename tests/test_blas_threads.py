"""The worker and the CLI shorten OpenBLAS's idle spin before numpy loads OpenBLAS."""
from __future__ import annotations

import os
import subprocess
import sys

from tests.processes import REPO

PROBE = ("import sys, {pkg}, os; print('numpy' in sys.modules, os.environ.get('OPENBLAS_THREAD_TIMEOUT'))")


def _probe(pkg: str, **env: str) -> str:
    clean = {k: v for k, v in os.environ.items() if k != "OPENBLAS_THREAD_TIMEOUT"}
    out = subprocess.run([sys.executable, "-c", PROBE.format(pkg=pkg)], cwd=REPO, env={**clean, **env},
                         capture_output=True, text=True, check=True)
    return out.stdout.strip()


def test_worker_and_cli_set_the_timeout_before_numpy_is_loaded():
    for pkg in ("worker", "tensorserve"):
        assert _probe(pkg) == "False 22"


def test_a_timeout_in_the_environment_wins():
    assert _probe("worker", OPENBLAS_THREAD_TIMEOUT="24") == "False 24"
