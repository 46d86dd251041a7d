"""`tensorserve worker` / `python -m worker.main`: one kernel-worker process serving worker.proto over gRPC.

Loads the model, sizes the KV pool from --kv-memory, listens, and (with
--ready-file) writes {"address": "host:port", "pid": ...} once it accepts
calls. SIGTERM/SIGINT stop the server within a 5 s grace period and exit 0,
unlinking the worker's shared-memory segments.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path

from shared.common_config import configure
from shared.exit_deadline import exit_within
from shared.options import ArgumentParser, add_flags, options_of
from worker import config as worker_config
from worker.config import WorkerConfig

log = logging.getLogger("worker.main")

STOP_GRACE_S = 5.0
OPTIONS = options_of(WorkerConfig)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The worker's flags, each with its TS_* variable (worker/config.py)."""
    add_flags(parser, OPTIONS)


def _write_ready_file(path: str, address: str, extra: dict) -> None:
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"address": address, "pid": os.getpid(), **extra}) + "\n")
    tmp.replace(target)        # atomic: a reader never sees half a file


def _backend_name(ops) -> str:
    return "cuda" if "cuda" in type(ops).__name__.lower() else "cpu"


def _show_startup_progress() -> None:
    # start-up progress (model load, KV capacity, address) is part of the worker's output:
    # shown unless the user asked for less than warnings
    worker_log = logging.getLogger("worker")
    if worker_log.getEffectiveLevel() == logging.WARNING:
        worker_log.setLevel(logging.INFO)


def run(flags: argparse.Namespace) -> int:
    configured = configure("worker", WorkerConfig, flags, check=worker_config.check_process, options=OPTIONS)
    if isinstance(configured, int):
        return configured
    args, _ = configured
    _show_startup_progress()
    from shared.errors import TensorServeError
    from shared.model_registry import model_name, resolve_model
    from shared.shm import cleanup_owned_segments, sweep_stale_segments

    stop = threading.Event()

    def _on_signal(signum, frame):
        log.info("received %s: stopping", signal.Signals(signum).name)
        stop.set()

    # installed before any arena exists, so shared.shm keeps these handlers and cleanup happens here
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, _on_signal)

    if args.ready_file:     # never leave a stale file from an earlier run for a supervisor to read
        Path(args.ready_file).unlink(missing_ok=True)
    removed = sweep_stale_segments()
    if removed:
        log.info("removed %d stale shared-memory segment(s) of dead processes", len(removed))

    from worker.model_runner import ModelRunner
    from worker.server import WorkerServicer, new_model_thread, start_server
    model_thread = new_model_thread()    # loads (compiling the kernels) and runs every step: one OpenMP team
    try:
        path = resolve_model(args.model)
        log.info("loading model %s from %s", args.model, path)
        t0 = time.perf_counter()
        draft = resolve_model(args.draft_model) if args.draft_model else None
        runner = model_thread.submit(ModelRunner, path, backend=args.backend, kv_memory=args.kv_memory,
                                     block_size=args.block_size, max_context=args.max_context,
                                     kv_cache_dtype=args.kv_cache_dtype, draft_model=draft, device=args.device,
                                     gpu_memory_utilization=args.gpu_memory_utilization,
                                     max_num_seqs=None if args.swa_full else args.max_num_seqs,
                                     max_num_batched_tokens=args.max_num_batched_tokens).result()
    except (TensorServeError, ValueError, OSError) as exc:
        model_thread.shutdown(wait=False)
        print(f"error: {exc}", file=sys.stderr)
        return 2
    cap, cfg = runner.capacity, runner.config
    backend = _backend_name(runner.ops)
    log.info("model %s ready in %.1fs: %s, %d layers, vocab %d, backend %s", args.model,
             time.perf_counter() - t0, cfg.architecture, cfg.n_layers, cfg.vocab_size, backend)
    log.info("KV capacity: %d blocks x %d tokens = %d tokens, max context %d%s (%s, %s)",
             cap.num_blocks, cap.block_size, cap.num_tokens, cap.max_context,
             f"; sliding-window layers: {cap.num_window_blocks} blocks of their own" if cap.num_window_blocks else "",
             f"--kv-memory {args.kv_memory} bytes" if backend == "cpu"
             else f"--gpu-memory-utilization {args.gpu_memory_utilization:g}", args.kv_cache_dtype)
    if stop.is_set():
        return 0

    servicer = WorkerServicer(runner, model_name(args.model), backend, args.tensor_transport, model_thread,
                              draft_model_name=model_name(args.draft_model) if args.draft_model else "")
    try:
        server, port = start_server(servicer, args.host, args.port, internal_token=args.internal_token)
    except (OSError, RuntimeError) as exc:
        print(f"error: cannot listen on {args.host}:{args.port}: {exc}", file=sys.stderr)
        return 2
    host = f"[{args.host}]" if ":" in args.host and not args.host.startswith("[") else args.host
    address = f"{host}:{port}"
    print(f"worker listening on {address} (pid {os.getpid()})", flush=True)
    log.info("serving %s on %s", args.model, address)
    if args.ready_file:
        _write_ready_file(args.ready_file, address,
                          {"model": model_name(args.model), "num_blocks": cap.num_blocks,
                           "block_size": cap.block_size, "max_context": cap.max_context})
    try:
        while not stop.wait(0.5):
            pass
    finally:
        log.info("stopping server (grace %.0fs)", STOP_GRACE_S)
        server.stop(STOP_GRACE_S).wait(STOP_GRACE_S + 1)
        servicer.close()
        cleanup_owned_segments()
        if args.ready_file:
            try:
                Path(args.ready_file).unlink()
            except OSError:
                pass
        log.info("worker stopped after %d steps", servicer.steps)
    exit_within()
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(prog="tensorserve worker",
                                     description="TensorServe kernel worker: one device, serving worker.proto over gRPC.")
    add_arguments(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    return run(build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
