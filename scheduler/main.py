"""`tensorserve scheduler`: the scheduler process (also `python -m scheduler.main`).

Every option is a flag, a TS_* environment variable and a --config key (scheduler/config.py).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import sys
from pathlib import Path

from scheduler import config as scheduler_config
from scheduler.config import SchedulerConfig
from shared.common_config import configure
from shared.exit_deadline import exit_within
from shared.options import ArgumentParser, add_flags, options_of

log = logging.getLogger("scheduler")


OPTIONS = options_of(SchedulerConfig)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The scheduler's flags, each with its TS_* variable (scheduler/config.py)."""
    add_flags(parser, OPTIONS)


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(prog="tensorserve scheduler",
                                     description="TensorServe scheduler: the engine loop in front of one worker.")
    add_arguments(parser)
    return parser


def run(flags: argparse.Namespace) -> int:
    configured = configure("scheduler", SchedulerConfig, flags, check=scheduler_config.check_process, options=OPTIONS)
    if isinstance(configured, int):
        return configured
    args, _ = configured
    from shared.shm import sweep_stale_segments
    swept = sweep_stale_segments()
    if swept:
        log.info("removed %d shared-memory segment(s) left by dead processes", len(swept))
    try:
        return asyncio.run(_serve(args))
    except OSError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


async def _serve(args: SchedulerConfig) -> int:
    from scheduler.server import SchedulerCore, build_server

    core = SchedulerCore(args)
    server, port = build_server(core, args.host, args.port)
    await server.start()
    core.start()
    health_task = asyncio.create_task(core.report_health())
    address = f"{args.host}:{port}"
    log.info("scheduler listening on %s (worker %s)", address, args.worker or "not set: waiting for RegisterWorker")
    if args.ready_file:
        path = Path(args.ready_file)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps({"address": address, "pid": os.getpid()}))
        tmp.replace(path)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()

    core.draining = True
    await health_task                       # NOT_SERVING from here on
    pending = core.in_flight()
    log.info("stopping: %d request(s) in flight, up to %.0fs to finish", pending, args.grace_period)
    deadline = loop.time() + args.grace_period
    while core.in_flight() and loop.time() < deadline:
        await asyncio.sleep(0.05)
    if core.in_flight():
        log.warning("grace period over: ending %d request(s)", core.in_flight())
        core.abort_all(f"the scheduler stopped before this request finished "
                       f"(grace period {args.grace_period:g}s)")
        await asyncio.sleep(0.2)
    await server.stop(1.0)
    await loop.run_in_executor(None, core.stop)
    log.info("scheduler stopped")
    exit_within()
    return 0


def main(argv: list[str] | None = None) -> int:
    return run(build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
