"""`tensorserve serve`: worker, scheduler and router as child processes on localhost.

One scheduler+worker group per model (`--model`, repeatable) and replica (`--replicas N`), each
worker with its own KV pool of --kv-memory, or with `--gpus all|0,1` one group per GPU (the whole
model on each; a layer split across GPUs is not implemented yet); one router in front of them all, which picks a
model's replica by cached prefix (router/prefix_routing.py). With one group the children are
named worker, scheduler and router; with several, worker/<model>/<replica> and so on.

Every option of the three processes that a user sets is a flag (and TS_* variable and --config
key) here; serve hands each to the process that uses it and sets the rest itself.

Internal ports are chosen free (each child reports its address in a ready
file); the public ones are the router's --http-port and --grpc-port. SIGTERM
or Ctrl-C stops the router first (it finishes in-flight requests within the
grace period), then the scheduler, then the worker. A child that dies is
restarted after a backoff (tensorserve/supervisor.py); meanwhile the router's /health turns 503 and
requests get a 503 naming it. If the router itself dies, serve stops everything.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import secrets
import signal
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from router import config as router_config
from router.config import RouterConfig
from scheduler.config import SchedulerConfig, check_speculative
from shared.common_config import LoggingOptions, configure
from shared.option_kinds import Integer, Number, Text
from shared.options import ConfigError, Resolved, add_flags, environment_without, option, options_of
from shared.served_models import ServedModel, served_models
from tensorserve.gpus import GPUS_HELP, GpuList, select_gpus
from tensorserve.supervisor import Child, free_port, write_status
from worker import config as worker_config
from worker.config import WorkerConfig

log = logging.getLogger("tensorserve.serve")


@dataclass(frozen=True, kw_only=True)
class ServeOptions(LoggingOptions):
    ready_file: str | None = option(None, "write the public addresses and the children's pids as JSON here "
                                    "once serving", Text(metavar="FILE"), env="TS_READY_FILE")
    start_timeout: float = option(600.0, "seconds each child process may take to start (the first start "
                                  "compiles the kernels)", Number(0, exclusive=True), env="TS_START_TIMEOUT")
    replicas: int = option(1, "scheduler+worker groups per model, each a worker with its own --kv-memory; the "
                           "router sends a request to the replica holding the longest cached prefix of it "
                           "(--routing)", Integer(1, 64))
    gpus: str | None = option(None, GPUS_HELP, GpuList())


# every user-facing option of the three processes, each once; serve assigns the internal ones
# (--model is the router's, repeatable: serve gives each worker its one model)
OPTIONS = options_of(RouterConfig, WorkerConfig, SchedulerConfig, ServeOptions, include_internal=False,
                     leave_out=[(WorkerConfig, "model")])
WORKER_MODEL = next(o for o in options_of(WorkerConfig) if o.name == "model")
CHILD_OPTIONS = {"worker": options_of(WorkerConfig), "scheduler": options_of(SchedulerConfig),
                 "router": options_of(RouterConfig)}


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_flags(p, OPTIONS)


def for_model(resolved: Resolved, model: ServedModel, device: int | None = None) -> Resolved:
    """The options as one model's worker sees them (its checks name --model); `device`: the GPU
    --gpus gives it, a cuda worker's."""
    on_gpu = {} if device is None else {"backend": "cuda", "device": device}
    return dataclasses.replace(resolved, options=[*resolved.options, WORKER_MODEL],
                               values={**resolved.values, "model": model.ref, **on_gpu},
                               sources={**resolved.sources, "model": resolved.source("models")})


def gpu_devices(resolved: Resolved) -> list[int] | None:
    """The GPUs --gpus names, found on this host (None without --gpus); a ConfigError naming what was
    found where one is missing, or where --gpus cannot apply."""
    v = resolved.values
    if v["gpus"] is None:
        return None
    if v["backend"] == "cpu":
        raise ConfigError(f"{resolved.where('gpus')}: the workers would run on the CPU "
                          f"({resolved.where('backend')}); give --backend cuda or auto")
    if len(v["models"] or ()) > 1 or v["replicas"] > 1:
        raise ConfigError(f"{resolved.where('gpus')}: serves one model with one replica per GPU; give one --model "
                          "and leave --replicas at 1")
    from worker.devices import detect_gpus
    from worker.placement import BackendUnavailable, cuda_problem
    try:
        gpus = select_gpus(v["gpus"], detect_gpus())
    except BackendUnavailable as exc:
        raise ConfigError(f"{resolved.where('gpus')}: {exc}") from None
    if (problem := cuda_problem()) is not None:
        raise ConfigError(f"{resolved.where('gpus')}: found {'; '.join(g.describe() for g in gpus)} but {problem}")
    return [g.index for g in gpus]


def _check(resolved: Resolved) -> None:
    router_config.check(resolved)
    models = served_models(resolved.values["models"], resolved.values["served_model_name"])
    devices = gpu_devices(resolved)
    for model in models:
        for device in devices or [None]:
            worker_config.check(for_model(resolved, model, device))
    groups = len(models) * resolved.values["replicas"]
    if devices is None and groups > 1 and worker_config.choose_placement(resolved).name == "cuda":
        raise ConfigError(f"{resolved.where('backend')}: {groups} workers (models × --replicas) would share GPU 0, "
                          "each sizing its KV pool from the same free memory; serve one model on each GPU "
                          "with --gpus, or --backend cpu")
    check_speculative(resolved)


def run(flags: argparse.Namespace) -> int:
    configured = configure("serve", ServeOptions, flags, check=_check, options=OPTIONS)
    if isinstance(configured, int):
        return configured
    args, resolved = configured
    token = secrets.token_hex(16)        # the children's internal token: only they know it
    models = served_models(resolved.values["models"], resolved.values["served_model_name"])
    devices = gpu_devices(resolved)
    # (model, replica, GPU): with --gpus, one replica of the one model per GPU
    groups = ([(models[0], r, d) for r, d in enumerate(devices)] if devices is not None
              else [(m, r, None) for m in models for r in range(args.replicas)])
    worker_cfg = resolved.build(WorkerConfig, host="127.0.0.1", port=0, internal_token=token)
    scheduler_cfg = resolved.build(SchedulerConfig, host="127.0.0.1", port=0, internal_token=token)
    router_cfg = resolved.build(RouterConfig, internal_token=token)
    stop = {"signal": None}

    def on_signal(signum, frame):
        stop["signal"] = signum
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)

    children: list[Child] = []
    with tempfile.TemporaryDirectory(prefix="tensorserve-") as tmp:
        ready_dir = Path(tmp)
        status_path = ready_dir / "supervisor.json"
        environment = environment_without(o for options in CHILD_OPTIONS.values() for o in options)

        def child(name: str, config: Any, group: str | None = None, env: dict[str, str] | None = None) -> Child:
            c = Child(name, CHILD_OPTIONS[name], config, ready_dir, args.start_timeout, {**environment, **(env or {})},
                      label=name if group is None else f"{name}/{group}")
            children.append(c)
            return c

        def group_name(model: ServedModel, replica: int, device: int | None) -> str | None:
            return (None if len(groups) == 1 and device is None
                    else f"{model.name}/{replica if device is None else f'gpu{device}'}")

        def worker(model: ServedModel, device: int | None) -> Any:
            config = dataclasses.replace(worker_cfg, model=model.ref, port=free_port())
            return config if device is None else dataclasses.replace(config, backend="cuda", device=device)

        def worker_env(device: int | None) -> dict[str, str]:
            # the worker sees its one GPU (CuPy's device 0); NVML still names it by `device`
            return {} if device is None else {"CUDA_VISIBLE_DEVICES": str(device), "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
        try:
            # fixed ports: a restarted worker or scheduler comes back where its client dials
            workers = [child("worker", worker(m, d), group_name(m, r, d), worker_env(d)) for m, r, d in groups]
            schedulers = [child("scheduler", dataclasses.replace(scheduler_cfg, worker=w.wait_ready(workers)["address"],
                                                                 port=free_port()), group_name(m, r, d))
                          for (m, r, d), w in zip(groups, workers)]
            addresses: dict[str, list[str]] = {}
            for (m, _, _), s in zip(groups, schedulers):
                addresses.setdefault(m.name, []).append(s.wait_ready(children)["address"])
            write_status(status_path, children)
            entries = tuple(f"{name}={','.join(a)}" if len(models) > 1 else ",".join(a)
                            for name, a in addresses.items())
            router = child("router", dataclasses.replace(router_cfg, scheduler=entries,
                                                         supervisor_status=str(status_path)))
            public = router.wait_ready(children)
        except RuntimeError as exc:
            print(f"error: {exc}", file=sys.stderr)
            for c in reversed(children):
                c.stop(2.0)
            return 1

        info = {**public, "pids": {c.label: c.proc.pid for c in children}}
        if args.ready_file:
            Path(args.ready_file).write_text(json.dumps(info))
        print(f"TensorServe is serving {', '.join(m.name for m in models)}"
              f"{f' ({args.replicas} replicas each)' if args.replicas > 1 else ''}"
              f"{f' (one replica per GPU: {devices})' if devices is not None else ''}: OpenAI API at http://{public['http']}/v1, "
              f"gRPC Generation at {public['grpc']}", flush=True)

        written = write_status(status_path, children)
        while stop["signal"] is None and router.alive:
            for c in (*workers, *schedulers):
                c.supervise(time.monotonic())
            written = write_status(status_path, children, unless=written)
            time.sleep(0.1)
        if not router.alive:
            print(f"tensorserve: the router exited with status {router.proc.returncode}; stopping.", file=sys.stderr,
                  flush=True)

        for c in reversed(children):      # router first: it drains in-flight requests
            c.stop(router_cfg.grace_period + 5)
        return 0 if stop["signal"] is not None else 1
