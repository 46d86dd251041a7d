"""A bound on how long a process may take to exit once its orderly stop is done.

After a server has drained its requests and closed its channels, what is left is library teardown
(grpc's pollers and completion queues, asyncio's loop close, interpreter finalization), and that
teardown can block when a peer went away at the same moment (grpc/grpc#37239, #40447). A
supervisor that sent SIGTERM would then have to SIGKILL a process that had already finished its
work; instead, a daemon thread ends the process with the orderly stop's exit code once `seconds`
have passed, after printing every thread's stack so the hang can be reported.
"""
from __future__ import annotations

import faulthandler
import logging
import os
import sys
import threading

EXIT_DEADLINE_S = 5.0

log = logging.getLogger("tensorserve.exit")


def exit_within(seconds: float = EXIT_DEADLINE_S, code: int = 0) -> None:
    """Called when the orderly stop is complete: the process exits with `code` within `seconds`,
    whatever the teardown after this does."""
    def force() -> None:
        log.warning("exit still pending %.0fs after an orderly stop: forcing it (thread stacks follow)",
                    seconds)
        try:
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
            sys.stderr.flush()
            sys.stdout.flush()
        finally:
            os._exit(code)

    timer = threading.Timer(seconds, force)
    timer.daemon = True
    timer.start()
