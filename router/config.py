"""The router's configuration: every option of `tensorserve router`, defined once (see shared/options.py)."""
from __future__ import annotations

from dataclasses import dataclass

from shared.common_config import (DEFAULT_MODEL, DrainOptions, InternalOptions, LoggingOptions, ModelCacheOptions,
                                  open_model)
from shared.option_kinds import Choice, FilePath, Flag, Number, Port, Repeated, Text
from shared.options import ConfigError, Resolved, option
from shared.served_models import ModelEntry, SchedulerGroup, scheduler_group, served_models

ROUTING_POLICIES = ("prefix-aware", "round-robin")


@dataclass(frozen=True, kw_only=True)
class RouterConfig(InternalOptions, DrainOptions, LoggingOptions, ModelCacheOptions):
    models: tuple[str, ...] = option(
        (DEFAULT_MODEL,), "a model to serve: a bundled model's name (see `tensorserve models`) or a GGUF path, "
        "optionally with the id clients send: NAME=MODEL; repeat the flag to serve several (serve starts a "
        "scheduler and worker per model and replica; a request names its model)", Repeated(ModelEntry()),
        flag="--model", short="-m", env="TS_MODEL")
    host: str = option("127.0.0.1", "address the public APIs (HTTP and gRPC) listen on", Text(metavar="HOST"),
                       env="TS_ROUTER_HOST")
    http_port: int = option(8000, "OpenAI-compatible HTTP port, 0 = any free port", Port(), aliases=("--port",))
    grpc_port: int = option(50051, "gRPC port (Generation, health, reflection), 0 = any free port", Port())
    api_key: str | None = option(None, "require 'Authorization: Bearer KEY' on HTTP /v1/* and this key in gRPC "
                                 "metadata (health checks and metrics stay open)", Text(metavar="KEY"),
                                 secret=True)
    unavailable_timeout: float = option(30.0, "seconds a new request waits for a scheduler or worker that is "
                                        "restarting (before any token) until it gets 503; 0 = answer at once",
                                        Number(0))
    protect_metrics: bool = option(False, "require the API key on /health and /metrics too (open by default, as "
                                   "vLLM's, for probes and scrapers)", Flag())
    served_model_name: str | None = option(None, "model id clients send and /v1/models lists (default: the "
                                           "bundled name or the GGUF file's stem); with several --model, "
                                           "name each as --model NAME=MODEL instead", Text(metavar="NAME"))
    routing: str = option("prefix-aware", "how a model's request picks one of its scheduler replicas: the "
                          "replica holding the longest cached prefix of its prompt (ties and misses: the one "
                          "with the fewest requests in flight), or round-robin (for comparison)",
                          Choice(*ROUTING_POLICIES))
    chat_template: str | None = option(None, "a Jinja chat template file used instead of the GGUF's own",
                                       FilePath())
    scheduler: tuple[str, ...] = option((), "scheduler host:port; a comma list is one model's replicas; with "
                                        "several models, name each: MODEL=host:port[,host:port]; repeatable",
                                        Repeated(SchedulerGroup()), env="TS_SCHEDULER_ADDRESS", internal=True)
    ready_file: str | None = option(None, 'write {"http": "host:port", "grpc": "host:port", "pid": N} here '
                                    "once both listen", Text(metavar="FILE"), env="TS_READY_FILE", internal=True)
    supervisor_status: str | None = option(None, "JSON file where serve keeps its children's states and restart "
                                           "counts, for /health and /metrics", Text(metavar="FILE"), internal=True)


def check(resolved: Resolved) -> None:
    """The model opens, a --chat-template file compiles, and --protect-metrics has a key to ask for."""
    if resolved.values["protect_metrics"] and not resolved.values["api_key"]:
        raise ConfigError(f"{resolved.where('protect_metrics')}: there is no --api-key (TS_API_KEY) to protect "
                          "/health and /metrics with; set one, or leave them open")
    check_models(resolved)
    path = resolved.values["chat_template"]
    if path is not None:
        from router.chat_template import ChatTemplate, ChatTemplateError
        try:
            ChatTemplate.from_file(path)
        except (ChatTemplateError, UnicodeDecodeError, OSError) as exc:
            raise ConfigError(f"{resolved.where('chat_template')}: {exc}") from None


def check_models(resolved: Resolved) -> None:
    """Each model opens; ids are distinct; --served-model-name names a single model; every
    --scheduler entry names a served model (or, unnamed, there is one model)."""
    from shared.errors import TensorServeError
    v = resolved.values
    entries = v["models"]
    if v["served_model_name"] and len(entries) > 1:
        raise ConfigError(f"{resolved.where('served_model_name')}: there are {len(entries)} models; name each "
                          "with --model NAME=MODEL instead")
    models = served_models(entries, v["served_model_name"])
    for m in models:
        try:
            open_model(m.ref, v["model_cache"])
        except (TensorServeError, OSError) as exc:
            raise ConfigError(f"{resolved.where('models')}: {exc}") from None
    ids = [m.name for m in models]
    if len(set(ids)) != len(ids):
        raise ConfigError(f"{resolved.where('models')}: two models have the id "
                          f"{next(i for i in ids if ids.count(i) > 1)!r}; name them apart with NAME=MODEL")
    for entry in v.get("scheduler") or ():
        name, _ = scheduler_group(entry)
        if name is None and len(models) > 1:
            raise ConfigError(f"{resolved.where('scheduler')}: with several models, name the model of each "
                              "scheduler entry: MODEL=host:port[,host:port]")
        if name is not None and name not in ids:
            raise ConfigError(f"{resolved.where('scheduler')}: {name!r} is none of the served models "
                              f"({', '.join(ids)})")
