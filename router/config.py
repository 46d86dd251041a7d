"""The router's configuration: every option of `tensorserve router`, defined once (see shared/options.py)."""
from __future__ import annotations

from dataclasses import dataclass

from shared.common_config import DrainOptions, InternalOptions, LoggingOptions, ModelOptions, check_model
from shared.option_kinds import Address, FilePath, Flag, Number, Port, Text
from shared.options import ConfigError, Resolved, option


@dataclass(frozen=True, kw_only=True)
class RouterConfig(InternalOptions, DrainOptions, LoggingOptions, ModelOptions):
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
                                           "bundled name or the GGUF file's stem)", Text(metavar="NAME"))
    chat_template: str | None = option(None, "a Jinja chat template file used instead of the GGUF's own",
                                       FilePath())
    scheduler: str | None = option(None, "scheduler host:port", Address(), env="TS_SCHEDULER_ADDRESS",
                                   internal=True)
    ready_file: str | None = option(None, 'write {"http": "host:port", "grpc": "host:port", "pid": N} here '
                                    "once both listen", Text(metavar="FILE"), env="TS_READY_FILE", internal=True)
    supervisor_status: str | None = option(None, "JSON file where serve keeps its children's states and restart "
                                           "counts, for /health and /metrics", Text(metavar="FILE"), internal=True)


def check(resolved: Resolved) -> None:
    """The model opens, a --chat-template file compiles, and --protect-metrics has a key to ask for."""
    if resolved.values["protect_metrics"] and not resolved.values["api_key"]:
        raise ConfigError(f"{resolved.where('protect_metrics')}: there is no --api-key (TS_API_KEY) to protect "
                          "/health and /metrics with; set one, or leave them open")
    check_model(resolved)
    path = resolved.values["chat_template"]
    if path is not None:
        from router.chat_template import ChatTemplate, ChatTemplateError
        try:
            ChatTemplate.from_file(path)
        except (ChatTemplateError, UnicodeDecodeError, OSError) as exc:
            raise ConfigError(f"{resolved.where('chat_template')}: {exc}") from None
