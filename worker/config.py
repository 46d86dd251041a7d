"""The worker's configuration: every option of `tensorserve worker`, defined once (see shared/options.py)."""
from __future__ import annotations

import logging
from dataclasses import dataclass

from shared.common_config import (BatchOptions, InternalOptions, LoggingOptions, ModelOptions, ModelRef,
                                  TransportOptions, check_exposure, check_model)
from shared.option_kinds import Choice, Flag, Integer, Number, Port, Size, Text
from shared.options import ConfigError, Resolved, option
from worker.gpu_memory import DEFAULT_GPU_MEMORY_UTILIZATION

DEFAULT_KV_MEMORY = 512 * 2**20


@dataclass(frozen=True, kw_only=True)
class WorkerConfig(InternalOptions, TransportOptions, LoggingOptions, ModelOptions, BatchOptions):
    host: str = option("127.0.0.1", "address the worker listens on", Text(metavar="HOST"), env="TS_WORKER_HOST",
                       internal=True)
    port: int = option(0, "gRPC port of the worker, 0 = a free one (printed)", Port(), env="TS_WORKER_PORT",
                       internal=True)
    ready_file: str | None = option(None, 'write {"address": "host:port", "pid": N, ...} here once listening',
                                    Text(metavar="FILE"), env="TS_WORKER_READY_FILE", internal=True)
    kv_memory: int = option(DEFAULT_KV_MEMORY, "memory of the KV block pool on the CPU backend, allocated and "
                            "made resident at start as llama.cpp's KV buffer is (on a GPU: "
                            "--gpu-memory-utilization); per worker (serve starts one per model and "
                            "replica, each with this much)", Size())
    block_size: int = option(16, "tokens per KV block", Integer(1, 4096))
    kv_cache_dtype: str = option("f16", "how the KV pool holds K and V: f16 (llama.cpp's default), or quantized in "
                                 "place as ggml's q8_0 (34 bytes per 32 values) or q4_0 (18), which hold 1.9x "
                                 "or 3.6x the tokens of f16 in the same --kv-memory (llama.cpp's "
                                 "--cache-type-k/-v)", Choice("f16", "q8_0", "q4_0"))
    max_context: int | None = option(None, "hard context length of a sequence; refused at start when "
                                     "--kv-memory (on a GPU: its free memory × --gpu-memory-utilization less "
                                     "the weights) cannot hold it (default: what the memory and the model allow)",
                                     Integer(1), aliases=("--max-model-len",))
    swa_full: bool = option(False, "keep every position for sliding-window layers too (llama.cpp's --swa-full); "
                            "by default a model mixing them with full-attention layers (Gemma 3) keeps their "
                            "K/V in a pool of their own holding only the window of --max-num-seqs sequences, "
                            "and the full layers get the rest of --kv-memory", Flag())
    backend: str = option("auto", "kernels backend: auto (cuda where nvidia-ml-py finds a GPU and CuPy imports, "
                          "else cpu, logging why), cpu, or cuda (an error at start without a GPU or CuPy: "
                          "pip install 'tensorserve[cuda]')", Choice("auto", "cpu", "cuda"))
    device: int = option(0, "the GPU a cuda worker runs on, by nvidia-smi's index; serve sets it per worker "
                         "from --gpus", Integer(0), env="TS_WORKER_DEVICE", internal=True)
    gpu_memory_utilization: float = option(DEFAULT_GPU_MEMORY_UTILIZATION, "on a GPU, the fraction of the device's "
                                           "free memory the worker takes: the weights, then the KV pool in what is "
                                           "left (less a 512 MiB reserve); --kv-memory sizes the CPU's pool only "
                                           "(as vLLM's flag)", Number(0, exclusive=True, maximum=1))
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
    if choose_placement(resolved).name == "cuda":
        check_gpu_memory(resolved, gguf, config, per_block)
        return
    fits = (v["kv_memory"] // per_block) * v["block_size"]
    if fits < v["block_size"]:
        raise ConfigError(f"{resolved.where('kv_memory')}: holds no KV block of {v['model']} "
                          f"({per_block} bytes at block size {v['block_size']}); give it at least that")
    if v["max_context"] is None:
        return
    kv_log = logging.getLogger("worker.kv_pool")
    quiet, kv_log.disabled = kv_log.disabled, True      # the runner logs the plan once it is real
    try:
        plan_capacity(config, v["kv_memory"], v["block_size"], v["max_context"], v["kv_cache_dtype"],
                      None if v["swa_full"] else v["max_num_seqs"], v["max_num_batched_tokens"])
    except ValueError:
        window_seqs = None if v["swa_full"] else v["max_num_seqs"]
        fits = plan_capacity(config, v["kv_memory"], v["block_size"], None, v["kv_cache_dtype"], window_seqs,
                             v["max_num_batched_tokens"]).num_tokens
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


def choose_placement(resolved: Resolved):
    """--backend (and --device) as this host can honour them: a BackendChoice, or a ConfigError naming
    what was found and what to install."""
    from worker.placement import BackendUnavailable, choose_backend
    v = resolved.values
    try:
        return choose_backend(v["backend"], v.get("device", 0))
    except BackendUnavailable as exc:
        raise ConfigError(f"{resolved.where('backend')}: {exc}") from None


def check_gpu_memory(resolved: Resolved, gguf, config, per_block: int) -> None:
    """The GPU's free memory × --gpu-memory-utilization holds the weights and a KV block, and
    --max-context where it is given."""
    from worker.gpu_memory import GpuBudget, check_fit, weight_bytes
    from shared.common_config import open_model
    v = resolved.values
    weights = weight_bytes(gguf)
    if v.get("draft_model"):            # the draft's weights too, unless they are the model's own
        draft = open_model(v["draft_model"], v["model_cache"])
        weights += weight_bytes(draft) if draft.path.resolve() != gguf.path.resolve() else 0
    budget = GpuBudget(choose_placement(resolved).gpu, v["gpu_memory_utilization"], weights)
    problem = check_fit(budget, per_block, v["block_size"], v["max_context"], v["model"], config.context_length)
    if problem is not None:
        name = "max_context" if v["max_context"] is not None and budget.kv_bytes >= per_block \
            else "gpu_memory_utilization"
        raise ConfigError(f"{resolved.where(name)}: {problem}")
