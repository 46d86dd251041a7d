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
import re
import signal
import sys
import threading
import time
from pathlib import Path

log = logging.getLogger("worker.main")

STOP_GRACE_S = 5.0
DEFAULT_KV_MEMORY = "512MiB"

_UNITS = {"": 1, "b": 1,
          "k": 2**10, "kb": 10**3, "kib": 2**10,
          "m": 2**20, "mb": 10**6, "mib": 2**20,
          "g": 2**30, "gb": 10**9, "gib": 2**30,
          "t": 2**40, "tb": 10**12, "tib": 2**40}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str | int) -> int:
    """'512MiB', '2GiB', '1.5G', '100MB', '67108864' to bytes (K/M/G/T alone are binary)."""
    if isinstance(text, int):
        return text
    m = _SIZE_RE.match(str(text))
    unit = m[2].lower() if m else None
    if m is None or unit not in _UNITS:
        raise argparse.ArgumentTypeError(
            f"invalid size {text!r}: use bytes or a number with KiB, MiB, GiB, TiB (or KB, MB, GB, TB)")
    value = int(float(m[1]) * _UNITS[unit])
    if value <= 0:
        raise argparse.ArgumentTypeError(f"size must be positive, got {text!r}")
    return value


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {value}")
    return value


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number, got {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"port must be in 0..65535, got {value}")
    return value


def _env(name: str, default=None):
    value = os.environ.get(name)
    return value if value not in (None, "") else default


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The worker's flags, each defaulting to its TS_* environment variable."""
    parser.add_argument("--model", "-m", default=_env("TS_MODEL", "smollm2-135m"),
                        help="bundled model name or path to a GGUF file [env TS_MODEL, default smollm2-135m]")
    parser.add_argument("--host", default=_env("TS_WORKER_HOST", "127.0.0.1"),
                        help="address to listen on [env TS_WORKER_HOST, default 127.0.0.1]")
    parser.add_argument("--port", type=_port, default=_env("TS_WORKER_PORT", "0"),
                        help="gRPC port; 0 picks a free one and prints it [env TS_WORKER_PORT, default 0]")
    parser.add_argument("--kv-memory", type=parse_size, default=_env("TS_KV_MEMORY", DEFAULT_KV_MEMORY),
                        help="memory for the KV block pool, allocated and made resident at start as "
                             "llama.cpp's KV buffer is: bytes or e.g. 512MiB, 2GiB "
                             f"[env TS_KV_MEMORY, default {DEFAULT_KV_MEMORY}]")
    parser.add_argument("--block-size", type=_positive_int, default=_env("TS_BLOCK_SIZE", "16"),
                        help="tokens per KV block [env TS_BLOCK_SIZE, default 16]")
    parser.add_argument("--max-context", type=_positive_int, default=_env("TS_MAX_CONTEXT"),
                        help="hard context length; fails at start when the KV memory cannot hold it "
                             "[env TS_MAX_CONTEXT, default: what the memory and the model allow]")
    parser.add_argument("--backend", choices=("cpu", "auto"), default=_env("TS_BACKEND", "auto"),
                        help="kernels backend [env TS_BACKEND, default auto]")
    parser.add_argument("--tensor-transport", choices=("auto", "shm", "inline"),
                        default=_env("TS_TENSOR_TRANSPORT", "auto"),
                        help="how Step responses carry large arrays: shared memory, inline bytes, or auto "
                             "(shm for a peer on this host) [env TS_TENSOR_TRANSPORT, default auto]")
    parser.add_argument("--ready-file", default=_env("TS_WORKER_READY_FILE"),
                        help="when listening, write {\"address\": \"host:port\", \"pid\": ...} to this file "
                             "[env TS_WORKER_READY_FILE]")


def _write_ready_file(path: str, address: str, extra: dict) -> None:
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"address": address, "pid": os.getpid(), **extra}) + "\n")
    tmp.replace(target)        # atomic: a reader never sees half a file


def _backend_name(ops) -> str:
    return "cuda" if "cuda" in type(ops).__name__.lower() else "cpu"


def _check_capacity(model_path, args) -> None:
    """Fails fast (before the weights load) when --max-context cannot fit; the message gives the numbers."""
    from shared.gguf_file import GGUFFile
    from shared.model_config import ModelConfig
    from worker.kv_pool import bytes_per_block, plan_capacity
    config = ModelConfig.from_gguf(GGUFFile(model_path))
    kv_log = logging.getLogger("worker.kv_pool")
    quiet, kv_log.disabled = kv_log.disabled, True     # the runner logs the plan once it is real
    try:
        plan_capacity(config, args.kv_memory, args.block_size, args.max_context)
    except ValueError as exc:
        per_block = bytes_per_block(config, args.block_size)
        fits = (args.kv_memory // per_block) * args.block_size
        raise ValueError(f"{exc} (--kv-memory {args.kv_memory} bytes fits {fits} tokens of context at "
                         f"block size {args.block_size}; the model's trained context is "
                         f"{config.context_length})") from None
    finally:
        kv_log.disabled = quiet


def _configure_logging(args) -> None:
    root = logging.getLogger()
    if not root.handlers:
        logging.basicConfig(level=str(getattr(args, "log_level", None) or "INFO").upper(),
                            format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # start-up progress (model load, KV capacity, address) is part of the worker's output:
    # shown unless the user asked for less than warnings
    worker_log = logging.getLogger("worker")
    if worker_log.getEffectiveLevel() == logging.WARNING:
        worker_log.setLevel(logging.INFO)


def run(args: argparse.Namespace) -> int:
    _configure_logging(args)
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
        _check_capacity(path, args)
        t0 = time.perf_counter()
        runner = model_thread.submit(ModelRunner, path, backend=args.backend, kv_memory=args.kv_memory,
                                     block_size=args.block_size, max_context=args.max_context).result()
    except (TensorServeError, ValueError, OSError) as exc:
        model_thread.shutdown(wait=False)
        print(f"error: {exc}", file=sys.stderr)
        return 2
    cap, cfg = runner.capacity, runner.config
    backend = _backend_name(runner.ops)
    log.info("model %s ready in %.1fs: %s, %d layers, vocab %d, backend %s", args.model,
             time.perf_counter() - t0, cfg.architecture, cfg.n_layers, cfg.vocab_size, backend)
    log.info("KV capacity: %d blocks x %d tokens = %d tokens, max context %d (--kv-memory %d bytes)",
             cap.num_blocks, cap.block_size, cap.num_tokens, cap.max_context, args.kv_memory)
    if stop.is_set():
        return 0

    servicer = WorkerServicer(runner, model_name(args.model), backend, args.tensor_transport, model_thread)
    try:
        server, port = start_server(servicer, args.host, args.port)
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
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m worker.main",
                                     description="TensorServe kernel worker: one device, serving worker.proto over gRPC.")
    parser.add_argument("--log-level", default=_env("TS_LOG_LEVEL", "INFO"),
                        help="logging level [env TS_LOG_LEVEL, default INFO]")
    add_arguments(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    return run(build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
