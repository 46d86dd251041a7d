from protos.tensorserve.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DescribeRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DescribeResponse(_message.Message):
    __slots__ = ("model_name", "architecture", "fingerprint", "vocab_size", "num_blocks", "block_size", "max_context", "n_layers", "backend", "hostname", "kv_heads", "head_dim", "kv_cache_dtype", "draft_model", "diffusion", "mask_token_id", "context_length", "num_window_blocks", "window")
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    ARCHITECTURE_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    N_LAYERS_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    HOSTNAME_FIELD_NUMBER: _ClassVar[int]
    KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    DRAFT_MODEL_FIELD_NUMBER: _ClassVar[int]
    DIFFUSION_FIELD_NUMBER: _ClassVar[int]
    MASK_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    NUM_WINDOW_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    WINDOW_FIELD_NUMBER: _ClassVar[int]
    model_name: str
    architecture: str
    fingerprint: str
    vocab_size: int
    num_blocks: int
    block_size: int
    max_context: int
    n_layers: int
    backend: str
    hostname: str
    kv_heads: int
    head_dim: int
    kv_cache_dtype: str
    draft_model: str
    diffusion: bool
    mask_token_id: int
    context_length: int
    num_window_blocks: int
    window: int
    def __init__(self, model_name: _Optional[str] = ..., architecture: _Optional[str] = ..., fingerprint: _Optional[str] = ..., vocab_size: _Optional[int] = ..., num_blocks: _Optional[int] = ..., block_size: _Optional[int] = ..., max_context: _Optional[int] = ..., n_layers: _Optional[int] = ..., backend: _Optional[str] = ..., hostname: _Optional[str] = ..., kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., kv_cache_dtype: _Optional[str] = ..., draft_model: _Optional[str] = ..., diffusion: _Optional[bool] = ..., mask_token_id: _Optional[int] = ..., context_length: _Optional[int] = ..., num_window_blocks: _Optional[int] = ..., window: _Optional[int] = ...) -> None: ...

class SeqChunk(_message.Message):
    __slots__ = ("seq_id", "token_ids", "start_pos", "block_table", "prompt_len", "sample", "params", "score_top_k", "prefix_ids", "score_targets", "num_draft", "diffusion", "window_block_table")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    START_POS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_TABLE_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LEN_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    SCORE_TOP_K_FIELD_NUMBER: _ClassVar[int]
    PREFIX_IDS_FIELD_NUMBER: _ClassVar[int]
    SCORE_TARGETS_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFT_FIELD_NUMBER: _ClassVar[int]
    DIFFUSION_FIELD_NUMBER: _ClassVar[int]
    WINDOW_BLOCK_TABLE_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    token_ids: _common_pb2.Tensor
    start_pos: int
    block_table: _common_pb2.Tensor
    prompt_len: int
    sample: bool
    params: _common_pb2.SamplingParams
    score_top_k: int
    prefix_ids: _common_pb2.Tensor
    score_targets: _common_pb2.Tensor
    num_draft: int
    diffusion: DiffusionStep
    window_block_table: _common_pb2.Tensor
    def __init__(self, seq_id: _Optional[int] = ..., token_ids: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., start_pos: _Optional[int] = ..., block_table: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., prompt_len: _Optional[int] = ..., sample: _Optional[bool] = ..., params: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., score_top_k: _Optional[int] = ..., prefix_ids: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., score_targets: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., num_draft: _Optional[int] = ..., diffusion: _Optional[_Union[DiffusionStep, _Mapping]] = ..., window_block_table: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ...) -> None: ...

class DiffusionStep(_message.Message):
    __slots__ = ("block_start", "block_end", "transfer_count", "params")
    BLOCK_START_FIELD_NUMBER: _ClassVar[int]
    BLOCK_END_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_COUNT_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    block_start: int
    block_end: int
    transfer_count: int
    params: _common_pb2.DiffusionParams
    def __init__(self, block_start: _Optional[int] = ..., block_end: _Optional[int] = ..., transfer_count: _Optional[int] = ..., params: _Optional[_Union[_common_pb2.DiffusionParams, _Mapping]] = ...) -> None: ...

class StepRequest(_message.Message):
    __slots__ = ("chunks", "finished", "step_id", "copy_blocks", "num_steps", "copy_window_blocks")
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    COPY_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_STEPS_FIELD_NUMBER: _ClassVar[int]
    COPY_WINDOW_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    chunks: _containers.RepeatedCompositeFieldContainer[SeqChunk]
    finished: _containers.RepeatedScalarFieldContainer[int]
    step_id: int
    copy_blocks: _containers.RepeatedCompositeFieldContainer[BlockCopy]
    num_steps: int
    copy_window_blocks: _containers.RepeatedCompositeFieldContainer[BlockCopy]
    def __init__(self, chunks: _Optional[_Iterable[_Union[SeqChunk, _Mapping]]] = ..., finished: _Optional[_Iterable[int]] = ..., step_id: _Optional[int] = ..., copy_blocks: _Optional[_Iterable[_Union[BlockCopy, _Mapping]]] = ..., num_steps: _Optional[int] = ..., copy_window_blocks: _Optional[_Iterable[_Union[BlockCopy, _Mapping]]] = ...) -> None: ...

class BlockCopy(_message.Message):
    __slots__ = ("src", "dst")
    SRC_FIELD_NUMBER: _ClassVar[int]
    DST_FIELD_NUMBER: _ClassVar[int]
    src: int
    dst: int
    def __init__(self, src: _Optional[int] = ..., dst: _Optional[int] = ...) -> None: ...

class SeqResult(_message.Message):
    __slots__ = ("seq_id", "token_id", "logprob", "top_ids", "top_logprobs", "score_ids", "score_logprobs", "score_target_logprobs", "accepted_ids", "accepted_logprobs", "committed_positions", "committed_ids")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    SCORE_IDS_FIELD_NUMBER: _ClassVar[int]
    SCORE_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    SCORE_TARGET_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_IDS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_POSITIONS_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_IDS_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    token_id: int
    logprob: float
    top_ids: _common_pb2.Tensor
    top_logprobs: _common_pb2.Tensor
    score_ids: _common_pb2.Tensor
    score_logprobs: _common_pb2.Tensor
    score_target_logprobs: _common_pb2.Tensor
    accepted_ids: _containers.RepeatedScalarFieldContainer[int]
    accepted_logprobs: _containers.RepeatedScalarFieldContainer[float]
    committed_positions: _containers.RepeatedScalarFieldContainer[int]
    committed_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, seq_id: _Optional[int] = ..., token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., top_ids: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., top_logprobs: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., score_ids: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., score_logprobs: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., score_target_logprobs: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., accepted_ids: _Optional[_Iterable[int]] = ..., accepted_logprobs: _Optional[_Iterable[float]] = ..., committed_positions: _Optional[_Iterable[int]] = ..., committed_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class StepResponse(_message.Message):
    __slots__ = ("results", "tokens_computed", "step_id", "later")
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_COMPUTED_FIELD_NUMBER: _ClassVar[int]
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    LATER_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[SeqResult]
    tokens_computed: int
    step_id: int
    later: _containers.RepeatedCompositeFieldContainer[StepResults]
    def __init__(self, results: _Optional[_Iterable[_Union[SeqResult, _Mapping]]] = ..., tokens_computed: _Optional[int] = ..., step_id: _Optional[int] = ..., later: _Optional[_Iterable[_Union[StepResults, _Mapping]]] = ...) -> None: ...

class StepResults(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[SeqResult]
    def __init__(self, results: _Optional[_Iterable[_Union[SeqResult, _Mapping]]] = ...) -> None: ...

class BlockRange(_message.Message):
    __slots__ = ("block_ids",)
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, block_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ExportBlocksRequest(_message.Message):
    __slots__ = ("blocks", "window_blocks")
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    WINDOW_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    blocks: BlockRange
    window_blocks: BlockRange
    def __init__(self, blocks: _Optional[_Union[BlockRange, _Mapping]] = ..., window_blocks: _Optional[_Union[BlockRange, _Mapping]] = ...) -> None: ...

class ExportBlocksResponse(_message.Message):
    __slots__ = ("kv",)
    KV_FIELD_NUMBER: _ClassVar[int]
    kv: _common_pb2.Tensor
    def __init__(self, kv: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ...) -> None: ...

class ImportBlocksRequest(_message.Message):
    __slots__ = ("blocks", "kv", "window_block_ids")
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KV_FIELD_NUMBER: _ClassVar[int]
    WINDOW_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    blocks: BlockRange
    kv: _common_pb2.Tensor
    window_block_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, blocks: _Optional[_Union[BlockRange, _Mapping]] = ..., kv: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., window_block_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ImportBlocksResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
