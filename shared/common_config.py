"""Options that more than one process takes, each defined once here and inherited by the
configurations that need it (`router/config.py`, `scheduler/config.py`, `worker/config.py`)."""
from __future__ import annotations

import faulthandler
import functools
import logging
import signal
import sys
from dataclasses import dataclass
from typing import Any, Callable

from shared.blas_threads import set_compute_threads
from shared.option_kinds import Choice, Integer, Kind, Number, Text
from shared.options import ConfigError, Option, Resolved, option, options_of, resolve

LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
DEFAULT_MODEL = "smollm2-135m"
DEFAULT_MODEL_CACHE = "~/.cache/tensorserve"


class ModelRef(Kind):
    """A bundled model's name or a GGUF path; `check_model` then opens it (read at start, not here,
    so that parsing a command line stays cheap)."""
    metavar = "MODEL"

    def __init__(self) -> None:
        from shared.model_registry import BUNDLED
        self.accepted = f"a bundled model ({', '.join(BUNDLED)}) or the path of a GGUF file"

    def parse(self, text: str) -> str:
        from pathlib import Path

        from shared.model_registry import BUNDLED
        text = text.strip()
        if text not in BUNDLED and not Path(text).expanduser().is_file():
            raise ValueError(f"{text!r} is neither a bundled model nor an existing file")
        return text


@dataclass(frozen=True, kw_only=True)
class LoggingOptions:
    log_level: str = option("info", "logging level", Choice(*LOG_LEVELS))


@dataclass(frozen=True, kw_only=True)
class ModelCacheOptions:
    model_cache: str = option(DEFAULT_MODEL_CACHE, "folder where bundled models assembled on first use "
                              "(gemma3-270m) are kept", Text(metavar="DIR"))


@dataclass(frozen=True, kw_only=True)
class ModelOptions(ModelCacheOptions):
    model: str = option(DEFAULT_MODEL, "bundled model name (see `tensorserve models`) or path to a GGUF file",
                        ModelRef(), short="-m")


@dataclass(frozen=True, kw_only=True)
class DrainOptions:
    grace_period: float = option(10.0, "seconds in-flight requests get to finish after SIGTERM or Ctrl-C",
                                 Number(0), aliases=("--shutdown-grace",))


@dataclass(frozen=True, kw_only=True)
class BatchOptions:
    """The scheduler batches under these; the worker sizes its sliding-window layers' pool from them."""
    max_num_seqs: int = option(64, "sequences running at once at most (a worker keeps this many sequences' "
                               "windows for the sliding-window layers of a model such as Gemma 3)", Integer(1))
    max_num_batched_tokens: int = option(256, "tokens computed per engine step at most (the prefill chunk "
                                         "budget; on a CPU worker a 256-token chunk is a ~0.4 s step)", Integer(1))


@dataclass(frozen=True, kw_only=True)
class TransportOptions:
    tensor_transport: str = option("auto", "how step tensors travel between scheduler and worker: shared "
                                   "memory (same host), inline bytes, or auto (shared memory for a peer on "
                                   "this host)", Choice("auto", "shm", "inline"))


@dataclass(frozen=True, kw_only=True)
class InternalOptions:
    internal_token: str | None = option(
        None, "shared secret that every internal call (router to scheduler, scheduler to worker) carries; "
        "required when the scheduler or worker listens beyond loopback; give all three the same one",
        Text(metavar="TOKEN"), secret=True, internal=True)


def check_exposure(resolved: Resolved, process: str) -> None:
    """A scheduler or worker reachable from other hosts must require the internal token, or its
    API (Submit, Step) would be open around the router's API key."""
    import ipaddress
    host = resolved.values["host"].strip("[]")
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback and not resolved.values.get("internal_token"):
        raise ConfigError(f"{resolved.where('host')}: the {process} would accept calls from other hosts with no "
                          "internal token; set --internal-token (TS_INTERNAL_TOKEN) to a shared secret, the same "
                          "on router, scheduler and worker (e.g. openssl rand -hex 16)")


def setup_logging(level: str, fmt: str = "%(asctime)s %(levelname)s %(name)s: %(message)s") -> None:
    logging.basicConfig(level=level.upper(), format=fmt)
    # `kill -USR1 PID` prints every thread's stack to stderr: what a process that will not stop
    # (or answer) is waiting on, without a debugger.
    if hasattr(signal, "SIGUSR1"):
        faulthandler.register(signal.SIGUSR1, all_threads=True, chain=False)


def log_effective(process: str, resolved: Resolved) -> None:
    """The options that differ from their defaults, and where each came from, once at start (as
    vLLM logs its non-default arguments); shown unless the level is above INFO."""
    log = logging.getLogger(f"tensorserve.config.{process}")
    if log.getEffectiveLevel() == logging.WARNING:
        log.setLevel(logging.INFO)
    items = resolved.non_default()
    log.info("%s options not at their defaults: %s", process, "; ".join(items) if items else "none")


def check_model(resolved: Resolved):
    """Opens the model's GGUF header and metadata (no weights): a missing package or a bad file
    is an error at the door. Returns the opened file (once per process: `serve` checks the
    router's and the worker's use of the same model)."""
    from shared.errors import TensorServeError
    try:
        return _open_model(resolved.values["model"], resolved.values["model_cache"])
    except (TensorServeError, OSError) as exc:
        raise ConfigError(f"{resolved.where('model')}: {exc}") from None


def open_model(model: str, model_cache: str):
    """A model argument's GGUF header (cached: the checks of one process open a model once)."""
    return _open_model(model, model_cache)


@functools.lru_cache(maxsize=4)
def _open_model(model: str, model_cache: str):
    from shared.gguf_file import GGUFFile
    from shared.model_registry import resolve_model, set_cache_dir
    set_cache_dir(model_cache)
    return GGUFFile(resolve_model(model))


def configure(process: str, cls: type | None, flags: Any, check: Callable[[Resolved], None] | None = None,
              options: list[Option] | None = None, announce: bool = True) -> tuple[Any, Resolved] | int:
    """A command's configuration (an instance of `cls`, if given) from its parsed flags, the
    environment and --config. Returns the exit status instead when there is nothing more to do:
    0 after --print-config, 2 after a bad value (one line on stderr, before anything starts)."""
    options = options if options is not None else options_of(cls)
    try:
        resolved = resolve(options, flags, config_file=getattr(flags, "config", None))
        if getattr(flags, "print_config", False):
            print(resolved.to_yaml(), end="")
            return 0
        config = resolved.build(cls) if cls is not None else None
        if "threads" in resolved.values:          # before the checks load numpy
            set_compute_threads(resolved.values["threads"])
        if "model_cache" in resolved.values:
            from shared.model_registry import set_cache_dir
            set_cache_dir(resolved.values["model_cache"])        # before anything resolves a model
        setup_logging(resolved.values["log_level"])
        if check is not None:
            check(resolved)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if announce:
        log_effective(process, resolved)
    return config, resolved
