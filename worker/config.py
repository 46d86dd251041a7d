"""The worker's configuration: every option of `tensorserve worker`, defined once (see shared/options.py)."""
from __future__ import annotations

import logging
from dataclasses import dataclass

from shared.common_config import (InternalOptions, LoggingOptions, ModelOptions, ModelRef, TransportOptions,
                                  check_exposure, check_model)
from shared.option_kinds import Choice, Integer, Port, Size, Text
from shared.options import ConfigError, Resolved, option

DEFAULT_KV_MEMORY = 512 * 2**20


@dataclass(frozen=True, kw_only=True)
class WorkerConfig(InternalOptions, TransportOptions, LoggingOptions, ModelOptions):
    host: str = option("127.0.0.1", "address the worker listens on", Text(metavar="HOST"), env="TS_WORKER_HOST",
                       internal=True)
    port: int = option(0, "gRPC port of the worker, 0 = a free one (printed)", Port(), env="TS_WORKER_PORT",
                       internal=True)
    ready_file: str | None = option(None, 'write {"address": "host:port", "pid": N, ...} here once listening',
                                    Text(metavar="FILE"), env="TS_WORKER_READY_FILE", internal=True)
    kv_memory: int = option(DEFAULT_KV_MEMORY, "memory of the KV block pool, allocated and made resident at "
                            "start as llama.cpp's KV buffer is; per worker (serve starts one per model and "
                            "replica, each with this much)", Size())
    block_size: int = option(16, "tokens per KV block", Integer(1, 4096))
    kv_cache_dtype: str = option("f16", "how the KV pool holds K and V: f16 (llama.cpp's default), or quantized in "
                                 "place as ggml's q8_0 (34 bytes per 32 values) or q4_0 (18), which hold 1.9x "
                                 "or 3.6x the tokens of f16 in the same --kv-memory (llama.cpp's "
                                 "--cache-type-k/-v)", Choice("f16", "q8_0", "q4_0"))
    max_context: int | None = option(None, "hard context length of a sequence; refused at start when "
                                     "--kv-memory cannot hold it (default: what the memory and the model allow)",
                                     Integer(1), aliases=("--max-model-len",))
    backend: str = option("auto", "kernels backend: cpu, or auto (the device found)", Choice("auto", "cpu"))
    draft_model: str | None = option(None, "draft model for --speculative draft: a bundled model name or a GGUF "
                                     "path sharing the model's vocabulary (e.g. one written by `tensorserve "
                                     "make-draft`); the worker runs it beside the model, its K/V in blocks of its "
                                     "own mirroring the model's", ModelRef())
    threads: int | None = option(None, "compute threads of the worker (numba and OpenBLAS; default: one "
                                 "per core)", Integer(1))


def check(resolved: Resolved) -> None:
    """What can be known before the weights load: the model opens, and --max-context fits in
    --kv-memory for this model (from its metadata)."""
    from shared.model_config import ModelConfig
    from worker.kv_pool import bytes_per_block, plan_capacity
    gguf = check_model(resolved)
    v = resolved.values
    check_draft_model(resolved, gguf)
    config = ModelConfig.from_gguf(gguf)
    try:
        per_block = bytes_per_block(config, v["block_size"], v["kv_cache_dtype"])
    except ValueError as exc:           # a quantized codec and a head_dim that is no multiple of 32
        raise ConfigError(f"{resolved.where('kv_cache_dtype')}: {exc}") from None
    fits = (v["kv_memory"] // per_block) * v["block_size"]
    if fits < v["block_size"]:
        raise ConfigError(f"{resolved.where('kv_memory')}: holds no KV block of {v['model']} "
                          f"({per_block} bytes at block size {v['block_size']}); give it at least that")
    if v["max_context"] is None:
        return
    kv_log = logging.getLogger("worker.kv_pool")
    quiet, kv_log.disabled = kv_log.disabled, True      # the runner logs the plan once it is real
    try:
        plan_capacity(config, v["kv_memory"], v["block_size"], v["max_context"], v["kv_cache_dtype"])
    except ValueError:
        if v["max_context"] > config.context_length:
            raise ConfigError(f"{resolved.where('max_context')}: exceeds the trained context of {v['model']}, "
                              f"{config.context_length} tokens; accepted: 1..{config.context_length}") from None
        raise ConfigError(f"{resolved.where('max_context')}: {resolved.where('kv_memory')} holds {fits} tokens "
                          f"of {v['model']}'s KV at block size {v['block_size']}; lower the context or raise "
                          "--kv-memory") from None
    finally:
        kv_log.disabled = quiet


def check_draft_model(resolved: Resolved, target) -> None:
    """--draft-model opens, is an architecture the worker runs, and shares the model's vocabulary."""
    name = resolved.values.get("draft_model")
    if not name:
        return
    from shared.common_config import open_model
    from shared.errors import TensorServeError
    from worker.draft_model import check_vocabulary
    from worker.models import model_class
    try:
        draft = open_model(name, resolved.values["model_cache"])
        model_class(draft.architecture, draft.path)
        check_vocabulary(target, draft, resolved.values["model"], name)
    except (TensorServeError, OSError, ValueError) as exc:
        raise ConfigError(f"{resolved.where('draft_model')}: {exc}") from None


def check_process(resolved: Resolved) -> None:
    """`tensorserve worker`: `check`, and no listening beyond loopback without the internal token."""
    check_exposure(resolved, "worker")
    check(resolved)
