"""The router process: the OpenAI-compatible HTTP API and the gRPC Generation service
in one asyncio (uvloop) event loop, in front of each served model's schedulers (one or
several replicas per model, router/replicas.py).

    python -m router.main --scheduler 127.0.0.1:50061 --http-port 8000 --grpc-port 50051
    python -m router.main --model a=smollm2-135m --model b=gemma3-270m \
        --scheduler a=127.0.0.1:50061,127.0.0.1:50062 --scheduler b=127.0.0.1:50063

`add_arguments(parser)` and `run(args)` are what `tensorserve router` calls.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import signal
import socket
import sys
from pathlib import Path

from router import config as router_config
from router.config import RouterConfig
from shared.common_config import configure
from shared.exit_deadline import exit_within
from shared.options import ArgumentParser, add_flags, options_of

log = logging.getLogger("tensorserve.router")


OPTIONS = options_of(RouterConfig)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The router's flags, each with its TS_* variable (router/config.py)."""
    add_flags(parser, OPTIONS)


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise SystemExit(f"router: cannot listen for HTTP on {host}:{port}: {exc.strerror}; "
                         "choose another --http-port (0 = any free port)") from None
    sock.listen(2048)
    sock.setblocking(False)
    return sock


def _hostport(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _write_ready(path: str, info: dict) -> None:
    target = Path(path)
    tmp = target.with_name(target.name + ".tmp")
    tmp.write_text(json.dumps(info))
    tmp.replace(target)


async def _report_health(models, reporter, draining: asyncio.Event, period_s: float = 0.5) -> None:
    """The standard health service follows the schedulers' (SERVING only while every model has a
    scheduler replica whose worker serves) until the router drains."""
    while not draining.is_set():
        ok = all([(await f.health())[0] for f in models])
        await reporter.set(ok)
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(draining.wait(), period_s)
    await reporter.shutdown()


async def serve(args: RouterConfig) -> int:
    import grpc
    import uvicorn

    from grpc_reflection.v1alpha import reflection

    from protos.tensorserve.v1 import router_pb2, router_pb2_grpc
    from shared.grpc_health import SERVICE_NAME as HEALTH_SERVICE
    from shared.grpc_errors import AsyncDecodeErrorInterceptor
    from shared.grpc_health import AsyncHealthReporter
    from router.model_table import ModelTable
    from shared.served_models import scheduler_group, served_models
    from router.http_api import create_app
    from router.metrics import RouterMetrics
    from router.server import GenerationServicer
    from shared.grpc_auth import api_key_interceptor

    if not args.scheduler:
        log.warning("no --scheduler given: generation requests will get 503 until one is configured")
    schedulers: dict[str | None, list[str]] = {}
    for entry in args.scheduler:
        name, addresses = scheduler_group(entry)
        schedulers.setdefault(name, []).extend(addresses)
    models = ModelTable.open(served_models(args.models, args.served_model_name), schedulers,
                             chat_template=args.chat_template, internal_token=args.internal_token,
                             unavailable_timeout=args.unavailable_timeout, routing=args.routing)
    metrics = RouterMetrics(models.default.served_model_name, args.supervisor_status)
    for f in models:
        f.metrics = metrics

    # gRPC
    interceptors = [AsyncDecodeErrorInterceptor(), *([api_key_interceptor(args.api_key)] if args.api_key else [])]
    grpc_server = grpc.aio.server(interceptors=interceptors, options=[
        ("grpc.so_reuseport", 0), ("grpc.max_receive_message_length", 64 << 20)])
    servicer = GenerationServicer(models, metrics)
    router_pb2_grpc.add_GenerationServicer_to_server(servicer, grpc_server)
    generation = router_pb2.DESCRIPTOR.services_by_name["Generation"].full_name
    health = AsyncHealthReporter(grpc_server, [generation])
    # generic clients (grpcurl, Postman, grpcui) list and call the API without our .proto files
    reflection.enable_server_reflection((generation, HEALTH_SERVICE, reflection.SERVICE_NAME), grpc_server)
    try:
        grpc_port = grpc_server.add_insecure_port(_hostport(args.host, args.grpc_port))
    except RuntimeError as exc:
        raise SystemExit(f"router: cannot listen for gRPC on {args.host}:{args.grpc_port} ({exc}); "
                         "choose another --grpc-port (0 = any free port)") from None
    if grpc_port == 0:
        raise SystemExit(f"router: cannot listen for gRPC on {args.host}:{args.grpc_port}; "
                         "choose another --grpc-port (0 = any free port)")

    # HTTP
    sock = _bind(args.host, args.http_port)
    http_port = sock.getsockname()[1]
    app = create_app(models, metrics, api_key=args.api_key, protect_metrics=args.protect_metrics)
    config = uvicorn.Config(app, loop="uvloop", lifespan="off", log_level="warning", access_log=False,
                            timeout_graceful_shutdown=max(1, int(args.grace_period)))

    class _Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self):   # signals are ours: both servers stop together
            yield

    http_server = _Server(config)
    await grpc_server.start()
    http_task = asyncio.create_task(http_server.serve(sockets=[sock]))

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)

    while not http_server.started:
        if http_task.done():
            await http_task
            log.error("router: the HTTP server failed to start")
            await grpc_server.stop(0)
            return 1
        await asyncio.sleep(0.02)

    info = {"http": _hostport(args.host, http_port), "grpc": _hostport(args.host, grpc_port), "pid": os.getpid()}
    log.warning("router serving %s on http://%s (OpenAI API) and grpc %s, schedulers %s (routing %s)",
                ", ".join(models.ids), info["http"], info["grpc"], " ".join(args.scheduler), args.routing)
    if args.ready_file:
        _write_ready(args.ready_file, info)

    draining = asyncio.Event()
    health_task = asyncio.create_task(_report_health(models, health, draining))
    stop_task = asyncio.create_task(stop.wait())
    await asyncio.wait({stop_task, http_task}, return_when=asyncio.FIRST_COMPLETED)
    log.warning("router: shutting down (grace %.0fs)", args.grace_period)
    draining.set()
    await health_task                       # NOT_SERVING while draining
    # Drain, then stop: grpc.aio's server.stop(grace) slows the shared gRPC poller (the scheduler
    # streams of in-flight HTTP requests crawl), so gRPC refuses new calls while both drain and
    # its server stops only once the in-flight work is done or the grace period is over.
    servicer.draining = True
    http_server.should_exit = True
    deadline = loop.time() + args.grace_period
    while (servicer.in_flight or not http_task.done()) and loop.time() < deadline:
        await asyncio.sleep(0.05)
    await grpc_server.stop(0)
    await asyncio.gather(http_task, return_exceptions=True)
    stop_task.cancel()
    await models.close()
    exit_within()
    return 0


def run(flags: argparse.Namespace) -> int:
    import uvloop
    configured = configure("router", RouterConfig, flags, check=router_config.check, options=OPTIONS)
    if isinstance(configured, int):
        return configured
    args, _ = configured
    try:
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            return runner.run(serve(args))
    except KeyboardInterrupt:
        return 130
    except Exception as exc:   # the model or its metadata: one line, not a traceback
        from shared.errors import TensorServeError
        if isinstance(exc, (TensorServeError, ValueError)):
            print(f"router: {exc}", file=sys.stderr)
            return 2
        raise


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(prog="tensorserve router", description="The TensorServe router process: "
                                     "OpenAI-compatible HTTP API and the gRPC Generation service.")
    add_arguments(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    return run(build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
