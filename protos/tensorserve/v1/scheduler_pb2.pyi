from protos.tensorserve.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class WatchPrefixCacheRequest(_message.Message):
    __slots__ = ("interval_ms",)
    INTERVAL_MS_FIELD_NUMBER: _ClassVar[int]
    interval_ms: int
    def __init__(self, interval_ms: _Optional[int] = ...) -> None: ...

class PrefixCacheUpdate(_message.Message):
    __slots__ = ("reset", "added", "removed", "block_size", "fingerprint", "serving", "in_flight")
    RESET_FIELD_NUMBER: _ClassVar[int]
    ADDED_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    SERVING_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    reset: bool
    added: _containers.RepeatedScalarFieldContainer[bytes]
    removed: _containers.RepeatedScalarFieldContainer[bytes]
    block_size: int
    fingerprint: str
    serving: bool
    in_flight: int
    def __init__(self, reset: _Optional[bool] = ..., added: _Optional[_Iterable[bytes]] = ..., removed: _Optional[_Iterable[bytes]] = ..., block_size: _Optional[int] = ..., fingerprint: _Optional[str] = ..., serving: _Optional[bool] = ..., in_flight: _Optional[int] = ...) -> None: ...

class SubmitRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "prompt_logprobs", "model", "eos_token_ids", "speculative", "diffusion")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SPECULATIVE_FIELD_NUMBER: _ClassVar[int]
    DIFFUSION_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    prompt_logprobs: int
    model: str
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    speculative: bool
    diffusion: _common_pb2.DiffusionOptions
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., prompt_logprobs: _Optional[int] = ..., model: _Optional[str] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., speculative: _Optional[bool] = ..., diffusion: _Optional[_Union[_common_pb2.DiffusionOptions, _Mapping]] = ...) -> None: ...

class TokenEvent(_message.Message):
    __slots__ = ("token_id", "logprob", "top_ids", "top_logprobs")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    top_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., top_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class SubmitEvent(_message.Message):
    __slots__ = ("tokens", "prompt_logprobs", "finish_reason", "usage", "error", "canvas")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    CANVAS_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedCompositeFieldContainer[TokenEvent]
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[TokenEvent]
    finish_reason: _common_pb2.FinishReason
    usage: _common_pb2.Usage
    error: _common_pb2.ErrorDetail
    canvas: DiffusionCanvas
    def __init__(self, tokens: _Optional[_Iterable[_Union[TokenEvent, _Mapping]]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[TokenEvent, _Mapping]]] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., usage: _Optional[_Union[_common_pb2.Usage, _Mapping]] = ..., error: _Optional[_Union[_common_pb2.ErrorDetail, _Mapping]] = ..., canvas: _Optional[_Union[DiffusionCanvas, _Mapping]] = ...) -> None: ...

class DiffusionCanvas(_message.Message):
    __slots__ = ("token_ids", "step", "mask_token_id")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    MASK_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    step: int
    mask_token_id: int
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., step: _Optional[int] = ..., mask_token_id: _Optional[int] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("running", "waiting", "preempted", "kv_blocks_total", "kv_blocks_free", "kv_used_fraction", "tokens_computed", "steps", "block_size", "max_context", "kv_blocks_cached", "prefix_cache_queried_tokens", "prefix_cache_hit_tokens", "preemptions", "status", "status_message", "components", "checkpoints", "speculative", "kv_window_blocks_total", "kv_window_blocks_free")
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    PREEMPTED_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_FREE_FIELD_NUMBER: _ClassVar[int]
    KV_USED_FRACTION_FIELD_NUMBER: _ClassVar[int]
    TOKENS_COMPUTED_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_CACHED_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_QUERIED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    STATUS_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    COMPONENTS_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINTS_FIELD_NUMBER: _ClassVar[int]
    SPECULATIVE_FIELD_NUMBER: _ClassVar[int]
    KV_WINDOW_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    KV_WINDOW_BLOCKS_FREE_FIELD_NUMBER: _ClassVar[int]
    running: int
    waiting: int
    preempted: int
    kv_blocks_total: int
    kv_blocks_free: int
    kv_used_fraction: float
    tokens_computed: int
    steps: int
    block_size: int
    max_context: int
    kv_blocks_cached: int
    prefix_cache_queried_tokens: int
    prefix_cache_hit_tokens: int
    preemptions: int
    status: _common_pb2.ServingStatus
    status_message: str
    components: _containers.RepeatedCompositeFieldContainer[_common_pb2.ComponentHealth]
    checkpoints: PrefixCheckpointStats
    speculative: SpeculativeStats
    kv_window_blocks_total: int
    kv_window_blocks_free: int
    def __init__(self, running: _Optional[int] = ..., waiting: _Optional[int] = ..., preempted: _Optional[int] = ..., kv_blocks_total: _Optional[int] = ..., kv_blocks_free: _Optional[int] = ..., kv_used_fraction: _Optional[float] = ..., tokens_computed: _Optional[int] = ..., steps: _Optional[int] = ..., block_size: _Optional[int] = ..., max_context: _Optional[int] = ..., kv_blocks_cached: _Optional[int] = ..., prefix_cache_queried_tokens: _Optional[int] = ..., prefix_cache_hit_tokens: _Optional[int] = ..., preemptions: _Optional[int] = ..., status: _Optional[_Union[_common_pb2.ServingStatus, str]] = ..., status_message: _Optional[str] = ..., components: _Optional[_Iterable[_Union[_common_pb2.ComponentHealth, _Mapping]]] = ..., checkpoints: _Optional[_Union[PrefixCheckpointStats, _Mapping]] = ..., speculative: _Optional[_Union[SpeculativeStats, _Mapping]] = ..., kv_window_blocks_total: _Optional[int] = ..., kv_window_blocks_free: _Optional[int] = ...) -> None: ...

class SpeculativeStats(_message.Message):
    __slots__ = ("method", "drafts", "draft_tokens", "accepted_tokens", "governed", "governor")
    METHOD_FIELD_NUMBER: _ClassVar[int]
    DRAFTS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    GOVERNED_FIELD_NUMBER: _ClassVar[int]
    GOVERNOR_FIELD_NUMBER: _ClassVar[int]
    method: str
    drafts: int
    draft_tokens: int
    accepted_tokens: int
    governed: bool
    governor: _containers.RepeatedCompositeFieldContainer[GovernorBucket]
    def __init__(self, method: _Optional[str] = ..., drafts: _Optional[int] = ..., draft_tokens: _Optional[int] = ..., accepted_tokens: _Optional[int] = ..., governed: _Optional[bool] = ..., governor: _Optional[_Iterable[_Union[GovernorBucket, _Mapping]]] = ...) -> None: ...

class GovernorBucket(_message.Message):
    __slots__ = ("batch_sizes", "state", "drafting", "draft_seconds_per_token", "plain_seconds_per_token", "pauses", "probes")
    BATCH_SIZES_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    DRAFTING_FIELD_NUMBER: _ClassVar[int]
    DRAFT_SECONDS_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    PLAIN_SECONDS_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    PAUSES_FIELD_NUMBER: _ClassVar[int]
    PROBES_FIELD_NUMBER: _ClassVar[int]
    batch_sizes: str
    state: str
    drafting: bool
    draft_seconds_per_token: float
    plain_seconds_per_token: float
    pauses: int
    probes: int
    def __init__(self, batch_sizes: _Optional[str] = ..., state: _Optional[str] = ..., drafting: _Optional[bool] = ..., draft_seconds_per_token: _Optional[float] = ..., plain_seconds_per_token: _Optional[float] = ..., pauses: _Optional[int] = ..., probes: _Optional[int] = ...) -> None: ...

class PrefixCheckpointStats(_message.Message):
    __slots__ = ("restored_tokens", "saved_blocks", "saves_dropped", "rejected", "stores", "restored_bytes", "restore_seconds")
    class RejectedEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    RESTORED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAVED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    SAVES_DROPPED_FIELD_NUMBER: _ClassVar[int]
    REJECTED_FIELD_NUMBER: _ClassVar[int]
    STORES_FIELD_NUMBER: _ClassVar[int]
    RESTORED_BYTES_FIELD_NUMBER: _ClassVar[int]
    RESTORE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    restored_tokens: int
    saved_blocks: int
    saves_dropped: int
    rejected: _containers.ScalarMap[str, int]
    stores: _containers.RepeatedCompositeFieldContainer[BlockStoreStats]
    restored_bytes: int
    restore_seconds: float
    def __init__(self, restored_tokens: _Optional[int] = ..., saved_blocks: _Optional[int] = ..., saves_dropped: _Optional[int] = ..., rejected: _Optional[_Mapping[str, int]] = ..., stores: _Optional[_Iterable[_Union[BlockStoreStats, _Mapping]]] = ..., restored_bytes: _Optional[int] = ..., restore_seconds: _Optional[float] = ...) -> None: ...

class BlockStoreStats(_message.Message):
    __slots__ = ("name", "hits", "misses", "puts", "put_failures", "errors", "evictions", "available")
    NAME_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    MISSES_FIELD_NUMBER: _ClassVar[int]
    PUTS_FIELD_NUMBER: _ClassVar[int]
    PUT_FAILURES_FIELD_NUMBER: _ClassVar[int]
    ERRORS_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    AVAILABLE_FIELD_NUMBER: _ClassVar[int]
    name: str
    hits: int
    misses: int
    puts: int
    put_failures: int
    errors: int
    evictions: int
    available: bool
    def __init__(self, name: _Optional[str] = ..., hits: _Optional[int] = ..., misses: _Optional[int] = ..., puts: _Optional[int] = ..., put_failures: _Optional[int] = ..., errors: _Optional[int] = ..., evictions: _Optional[int] = ..., available: _Optional[bool] = ...) -> None: ...

class RegisterWorkerRequest(_message.Message):
    __slots__ = ("worker_id", "address", "hostname")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    HOSTNAME_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    address: str
    hostname: str
    def __init__(self, worker_id: _Optional[str] = ..., address: _Optional[str] = ..., hostname: _Optional[str] = ...) -> None: ...

class RegisterWorkerResponse(_message.Message):
    __slots__ = ("accepted", "message")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    message: str
    def __init__(self, accepted: _Optional[bool] = ..., message: _Optional[str] = ...) -> None: ...
