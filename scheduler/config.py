"""The scheduler's configuration: every option of `tensorserve scheduler`, defined once (see shared/options.py)."""
from __future__ import annotations

from dataclasses import dataclass

from shared.common_config import (DEFAULT_MODEL_CACHE, BatchOptions, DrainOptions, InternalOptions,
                                   LoggingOptions, TransportOptions, check_exposure)
from shared.option_kinds import Address, Choice, Flag, Integer, Number, Port, Size, Text
from shared.options import ConfigError, Resolved, option


@dataclass(frozen=True, kw_only=True)
class SchedulerConfig(InternalOptions, TransportOptions, DrainOptions, LoggingOptions, BatchOptions):
    host: str = option("127.0.0.1", "address the scheduler listens on", Text(metavar="HOST"),
                       env="TS_SCHEDULER_HOST", internal=True)
    port: int = option(0, "gRPC port of the scheduler, 0 = a free one", Port(), env="TS_SCHEDULER_PORT",
                       internal=True)
    worker: str | None = option(None, "worker host:port to dial; optional when the worker registers itself "
                                "(RegisterWorker)", Address(), env="TS_WORKER_ADDRESS", internal=True)
    ready_file: str | None = option(None, 'write {"address": "host:port", "pid": N} here once listening',
                                    Text(metavar="FILE"), env="TS_SCHEDULER_READY_FILE", internal=True)
    max_prefill_tokens_while_decoding: int = option(
        48, "prompt tokens a step that also decodes takes at most: a step's time is the running requests' "
        "inter-token latency, so this bounds it while new prompts arrive", Integer(1))
    num_decode_steps: int = option(1, "tokens a step that only decodes computes in one worker call (multi-step "
                                   "scheduling): the host's work per step is paid once for all of them, and "
                                   "tokens reach clients that many at a time", Integer(1, 64))
    speculative: str = option("ngram", "speculative decoding: drafted tokens verified by the model in one pass "
                              "(greedy output unchanged, sampling keeps its distribution); ngram = prompt "
                              "lookup over the prompt and the text so far; draft = a draft model the worker "
                              "runs beside the model (--draft-model), greedy drafts; off = none; a request's "
                              "\"speculative\": false turns it off for that request", Choice("off", "ngram", "draft"))
    speculative_governor: bool = option(True, "measure the time per emitted token with and without drafting, per "
                                        "range of batch sizes, and pause drafting where it does not pay (steps "
                                        "then run as with --speculative off), probing again later", Flag())
    num_speculative_tokens: int = option(5, "tokens drafted per sequence and step at most, with --speculative (a "
                                         "sequence's own length grows by 2 after drafts accepted whole, "
                                         "shrinks by 1 after others)",
                                         Integer(1, 16), aliases=("--num-spec-tokens",))
    prompt_lookup_min: int = option(2, "shortest n-gram the ngram proposer looks up (vLLM's prompt_lookup_min; "
                                    "one repeated token drafts too often where the text is not copied)",
                                    Integer(1, 64))
    prompt_lookup_max: int = option(4, "longest n-gram the ngram proposer looks up, tried first (vLLM's "
                                    "prompt_lookup_max)", Integer(1, 64))
    enable_prefix_caching: bool = option(True, "reuse the KV of blocks shared with earlier prompts", Flag())
    prefix_checkpoints: bool = option(True, "keep computed prompt blocks in the checkpoint stores (the "
                                      "--checkpoint-dir folder, and Redis with --redis-url) and restore them "
                                      "instead of prefilling again, after restarts and across servers",
                                      Flag())
    checkpoint_dir: str = option(DEFAULT_MODEL_CACHE + "/checkpoints", "folder of the local prefix-checkpoint "
                                 "store (the SSD tier), one subfolder per model", Text(metavar="DIR"))
    checkpoint_dir_max_bytes: int = option(8 * 2**30, "size cap of --checkpoint-dir (least recently used "
                                           "blocks are removed past it)", Size())
    redis_url: str | None = option(None, "Redis for prefix checkpoints shared by every server of a model, e.g. "
                                   "redis://redis:6379/0; serving goes on while it is unreachable",
                                   Text(metavar="URL"))
    redis_ttl: int = option(7 * 86400, "seconds a checkpoint block lives in Redis after it is written",
                            Integer(1))
    redis_max_bytes: int = option(4 * 2**30, "size cap of the blocks this model keeps in Redis (least recently "
                                  "used removed past it)", Size())
    worker_probe_after: float = option(10.0, "seconds a worker step may run before the scheduler asks the "
                                       "worker's health, and drops the connection if no answer comes",
                                       Number(0, exclusive=True), env="TS_WORKER_PROBE_AFTER_S")


SPECULATIVE_OPTIONS = ("speculative", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max",
                       "speculative_governor")


def check_speculative(resolved: Resolved) -> None:
    """N-gram bounds that contradict each other, and (where the command also takes the worker's
    --draft-model: serve, generate) --speculative draft without a draft model or a draft model
    without --speculative draft, refused at the door (scheduler, serve and generate)."""
    values = resolved.values
    if "draft_model" in values:
        if values["speculative"] == "draft" and not values["draft_model"]:
            raise ConfigError(f"{resolved.where('speculative')} needs a draft model: give --draft-model "
                              "(TS_DRAFT_MODEL) a GGUF sharing the model's vocabulary, e.g. one written by "
                              "`tensorserve make-draft --model MODEL --layers N --out FILE`")
        if values["draft_model"] and values["speculative"] != "draft":
            raise ConfigError(f"{resolved.where('draft_model')} is only used with --speculative draft "
                              f"(it is {values['speculative']})")
    if values["prompt_lookup_min"] > values["prompt_lookup_max"]:
        raise ConfigError(f"{resolved.where('prompt_lookup_min')} is above {resolved.where('prompt_lookup_max')}")


def check_process(resolved: Resolved) -> None:
    """`tensorserve scheduler`: no listening beyond loopback without the internal token."""
    check_exposure(resolved, "scheduler")
    check_speculative(resolved)
