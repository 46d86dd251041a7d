"""`tensorserve scheduler`: the scheduler process (also `python -m scheduler.main`).

Every flag has a TS_* environment variable; the flag wins.
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

log = logging.getLogger("scheduler")


def _env(name: str, default=None):
    value = os.environ.get(name)
    return default if value in (None, "") else value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default=_env("TS_SCHEDULER_HOST", "127.0.0.1"),
                        help="address to listen on [env TS_SCHEDULER_HOST, default 127.0.0.1]")
    parser.add_argument("--port", type=int, default=int(_env("TS_SCHEDULER_PORT", 0)),
                        help="gRPC port, 0 = a free port [env TS_SCHEDULER_PORT, default 0]")
    parser.add_argument("--worker", default=_env("TS_WORKER_ADDRESS"),
                        help="worker host:port to dial; optional when the worker registers itself "
                             "(RegisterWorker) [env TS_WORKER_ADDRESS]")
    parser.add_argument("--max-num-seqs", type=int, default=int(_env("TS_MAX_NUM_SEQS", 64)),
                        help="sequences running at once at most [env TS_MAX_NUM_SEQS, default 64]")
    parser.add_argument("--max-num-batched-tokens", type=int, default=int(_env("TS_MAX_NUM_BATCHED_TOKENS", 256)),
                        help="tokens computed per step at most (prefill chunk budget) "
                             "[env TS_MAX_NUM_BATCHED_TOKENS, default 256: on a CPU worker one 256-token chunk is a ~0.4 s step, which bounds the decodes' inter-token latency]")
    parser.add_argument("--max-prefill-tokens-while-decoding", type=int,
                        default=int(_env("TS_MAX_PREFILL_TOKENS_WHILE_DECODING", 48)),
                        help="prompt tokens a step that also decodes takes at most; a step's time is the "
                             "decodes' inter-token latency, so this bounds it while prompts arrive "
                             "[env TS_MAX_PREFILL_TOKENS_WHILE_DECODING, default 48]")
    parser.add_argument("--num-decode-steps", type=int, default=int(_env("TS_NUM_DECODE_STEPS", 1)),
                        help="tokens a step that only decodes (nothing waiting) computes in one worker call, "
                             "each sequence's next input the token it sampled (vLLM's multi-step "
                             "scheduling): the host's work per step is paid once for all of them, and "
                             "tokens reach clients that many at a time [env TS_NUM_DECODE_STEPS, default 1]")
    parser.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                        default=_env("TS_ENABLE_PREFIX_CACHING", "1") not in ("0", "false", "no"),
                        help="reuse the KV of full blocks shared with earlier prompts "
                             "[env TS_ENABLE_PREFIX_CACHING, default on]")
    parser.add_argument("--tensor-transport", choices=("auto", "shm", "inline"),
                        default=_env("TS_TENSOR_TRANSPORT", "auto"),
                        help="how step tensors travel: shared memory (same host), inline bytes, or auto "
                             "[env TS_TENSOR_TRANSPORT, default auto]")
    parser.add_argument("--grace-period", type=float, default=float(_env("TS_GRACE_PERIOD", 10.0)),
                        help="seconds in-flight requests get to finish after SIGTERM [env TS_GRACE_PERIOD, default 10]")
    parser.add_argument("--ready-file", default=_env("TS_SCHEDULER_READY_FILE"),
                        help='write {"address": "host:port", "pid": N} here once listening '
                             "[env TS_SCHEDULER_READY_FILE]")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m scheduler.main",
                                     description="TensorServe scheduler: the engine loop in front of one worker.")
    parser.add_argument("--log-level", default=_env("TS_LOG_LEVEL", "INFO"),
                        help="logging level [env TS_LOG_LEVEL, default INFO]")
    add_arguments(parser)
    return parser


def _check(args: argparse.Namespace) -> str | None:
    if args.max_num_seqs < 1:
        return f"--max-num-seqs must be >= 1, got {args.max_num_seqs}"
    if args.max_num_batched_tokens < 1:
        return f"--max-num-batched-tokens must be >= 1, got {args.max_num_batched_tokens}"
    if args.max_prefill_tokens_while_decoding < 1:
        return f"--max-prefill-tokens-while-decoding must be >= 1, got {args.max_prefill_tokens_while_decoding}"
    if args.num_decode_steps < 1:
        return f"--num-decode-steps must be >= 1, got {args.num_decode_steps}"
    if args.grace_period < 0:
        return f"--grace-period must be >= 0, got {args.grace_period}"
    if args.worker and ":" not in args.worker:
        return f"--worker must be host:port, got {args.worker!r}"
    return None


def run(args: argparse.Namespace) -> int:
    problem = _check(args)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    from shared.shm import sweep_stale_segments
    swept = sweep_stale_segments()
    if swept:
        log.info("removed %d shared-memory segment(s) left by dead processes", len(swept))
    try:
        return asyncio.run(_serve(args))
    except OSError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


async def _serve(args: argparse.Namespace) -> int:
    from scheduler.server import SchedulerCore, build_server

    core = SchedulerCore(args.worker, args.tensor_transport, max_num_seqs=args.max_num_seqs,
                         max_num_batched_tokens=args.max_num_batched_tokens,
                         max_prefill_tokens_while_decoding=args.max_prefill_tokens_while_decoding,
                         enable_prefix_caching=args.enable_prefix_caching, num_decode_steps=args.num_decode_steps)
    server, port = build_server(core, args.host, args.port)
    await server.start()
    core.start()
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
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
