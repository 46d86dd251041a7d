"""A process whose teardown blocks after its orderly stop still exits, with the stop's code and the
stacks of what blocked it (shared/exit_deadline.py); SIGUSR1 prints a running process's stacks
(shared/common_config.setup_logging)."""
from __future__ import annotations

import signal
import subprocess
import sys
import time

from tests.processes import REPO

BLOCKED_TEARDOWN = """
import threading
from shared.exit_deadline import exit_within

def teardown_that_never_ends():
    threading.Event().wait()

exit_within(0.5, code=3)
threading.Thread(target=teardown_that_never_ends, name="stuck-teardown").start()   # not a daemon
"""


def test_blocked_teardown_ends_with_the_orderly_code_and_its_stacks():
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", BLOCKED_TEARDOWN], cwd=REPO, capture_output=True, text=True,
                          timeout=30)
    assert proc.returncode == 3, proc.stderr
    assert time.monotonic() - started < 20
    assert "forcing it" in proc.stderr
    assert "teardown_that_never_ends" in proc.stderr          # the blocked thread's stack


def test_a_process_that_exits_on_time_keeps_its_own_code():
    proc = subprocess.run([sys.executable, "-c", "from shared.exit_deadline import exit_within\n"
                           "exit_within(30, code=0)\nraise SystemExit(4)"],
                          cwd=REPO, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 4
    assert "forcing it" not in proc.stderr


def test_sigusr1_prints_every_thread_stack_and_the_process_goes_on():
    script = ("import sys, time\nfrom shared.common_config import setup_logging\nsetup_logging('info')\n"
              "print('ready', flush=True)\n"
              "def waiting_for_work():\n    time.sleep(3)\nwaiting_for_work()\nprint('still running', flush=True)\n")
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        time.sleep(0.3)
        proc.send_signal(signal.SIGUSR1)
        out, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    assert "waiting_for_work" in err
    assert "still running" in out
