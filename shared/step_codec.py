"""The step contract (shared/step.py) and SamplingParams to and from their protobuf messages.

Arrays travel through a ``TensorCodec`` (shared/shm.py): shared memory for a
peer on this host, inline bytes otherwise. Without a codec everything is
inline. Encoding a message recycles the codec's arena, so a sender uses one
codec per peer and encodes its next message only after the peer has read the
previous one (true of Step: one request, one response).
"""
from __future__ import annotations

import numpy as np

from protos.tensorserve.v1 import common_pb2, worker_pb2
from shared.diffusion_params import DiffusionParams
from shared.sampling_params import SamplingParams
from shared.tensor_codec import TensorCodec
from shared.step import DiffusionStep, SeqChunk, SeqResult, StepRequest, StepResult

__all__ = ["sampling_params_to_proto", "sampling_params_from_proto", "diffusion_params_to_proto",
           "diffusion_params_from_proto", "step_request_to_proto",
           "step_request_from_proto", "step_result_to_proto", "step_result_from_proto"]

_INT_FIELDS = ("max_tokens", "top_k")
_FLOAT_FIELDS = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")
_OPTIONAL_FIELDS = _INT_FIELDS + _FLOAT_FIELDS + ("seed", "ignore_eos", "logprobs")

_inline_codec: TensorCodec | None = None


def _codec(codec: TensorCodec | None) -> TensorCodec:
    global _inline_codec
    if codec is not None:
        return codec
    if _inline_codec is None:
        _inline_codec = TensorCodec("inline")
    return _inline_codec


# ----------------------------------------------------------------- sampling parameters
def sampling_params_to_proto(params: SamplingParams,
                             out: common_pb2.SamplingParams | None = None) -> common_pb2.SamplingParams:
    """Every field is written (with presence), so the receiver gets exactly these values."""
    msg = common_pb2.SamplingParams() if out is None else out
    for name in _INT_FIELDS:
        setattr(msg, name, int(getattr(params, name)))
    for name in _FLOAT_FIELDS:
        setattr(msg, name, float(getattr(params, name)))
    msg.ignore_eos = bool(params.ignore_eos)
    if params.seed is not None:
        msg.seed = int(params.seed)
    if params.logprobs is not None:
        msg.logprobs = int(params.logprobs)
    msg.stop_token_ids[:] = [int(t) for t in params.stop_token_ids]
    return msg


def sampling_params_from_proto(msg: common_pb2.SamplingParams) -> SamplingParams:
    """Unset fields take SamplingParams' defaults. Not validated: call .validate() where input is untrusted."""
    kwargs = {name: getattr(msg, name) for name in _OPTIONAL_FIELDS if msg.HasField(name)}
    return SamplingParams(stop_token_ids=tuple(msg.stop_token_ids), **kwargs)


# ----------------------------------------------------------------- diffusion parameters
_DIFFUSION_FIELDS = tuple(f for f in DiffusionParams.__dataclass_fields__)


def diffusion_params_to_proto(params: DiffusionParams,
                              out: common_pb2.DiffusionParams | None = None) -> common_pb2.DiffusionParams:
    """Every field is written (with presence), so the receiver gets exactly these values."""
    msg = common_pb2.DiffusionParams() if out is None else out
    for name in _DIFFUSION_FIELDS:
        setattr(msg, name, getattr(params, name))
    return msg


def diffusion_params_from_proto(msg: common_pb2.DiffusionParams) -> DiffusionParams:
    """Unset fields take DiffusionParams' defaults. Not validated: call .validate() on untrusted input."""
    return DiffusionParams(**{name: getattr(msg, name) for name in _DIFFUSION_FIELDS if msg.HasField(name)})


# ----------------------------------------------------------------- step request
def step_request_to_proto(request: StepRequest, codec: TensorCodec | None = None,
                          step_id: int = 0) -> worker_pb2.StepRequest:
    codec = _codec(codec)
    codec.begin_message()
    msg = worker_pb2.StepRequest(step_id=step_id, num_steps=int(request.num_steps))
    for c in request.chunks:
        m = msg.chunks.add()
        m.seq_id = int(c.seq_id)
        codec.encode_into(c.token_ids, m.token_ids)
        m.start_pos = int(c.start_pos)
        codec.encode_into(c.block_table, m.block_table)
        m.prompt_len = int(c.prompt_len)
        m.sample = bool(c.sample)
        if c.params is not None:
            sampling_params_to_proto(c.params, m.params)
        m.score_top_k = int(c.score_top_k)
        if c.prefix_ids is not None:
            codec.encode_into(np.asarray(c.prefix_ids, np.int64), m.prefix_ids)
        if c.score_targets is not None:
            codec.encode_into(np.asarray(c.score_targets, np.int64), m.score_targets)
        m.num_draft = int(c.num_draft)
        if c.diffusion is not None:
            d = c.diffusion
            m.diffusion.block_start, m.diffusion.block_end = int(d.block_start), int(d.block_end)
            m.diffusion.transfer_count = int(d.transfer_count)
            diffusion_params_to_proto(d.params, m.diffusion.params)
        if c.window_table is not None:
            codec.encode_into(c.window_table, m.window_block_table)
    msg.finished[:] = [int(s) for s in request.finished]
    for src, dst in request.copy_blocks:
        msg.copy_blocks.add(src=int(src), dst=int(dst))
    for src, dst in request.copy_window_blocks:
        msg.copy_window_blocks.add(src=int(src), dst=int(dst))
    return msg


def step_request_from_proto(msg: worker_pb2.StepRequest, codec: TensorCodec | None = None) -> StepRequest:
    codec = _codec(codec)
    chunks = [
        SeqChunk(
            seq_id=m.seq_id,
            token_ids=codec.decode(m.token_ids),
            start_pos=m.start_pos,
            block_table=codec.decode(m.block_table),
            prompt_len=m.prompt_len,
            sample=m.sample,
            params=sampling_params_from_proto(m.params) if m.HasField("params") else None,
            score_top_k=m.score_top_k,
            prefix_ids=codec.decode(m.prefix_ids) if m.HasField("prefix_ids") else None,
            score_targets=codec.decode(m.score_targets) if m.HasField("score_targets") else None,
            num_draft=m.num_draft,
            diffusion=DiffusionStep(m.diffusion.block_start, m.diffusion.block_end, m.diffusion.transfer_count,
                                    diffusion_params_from_proto(m.diffusion.params))
            if m.HasField("diffusion") else None,
            window_table=codec.decode(m.window_block_table) if m.HasField("window_block_table") else None,
        )
        for m in msg.chunks
    ]
    return StepRequest(chunks, finished=list(msg.finished),
                       copy_blocks=[(c.src, c.dst) for c in msg.copy_blocks], num_steps=max(1, msg.num_steps),
                       copy_window_blocks=[(c.src, c.dst) for c in msg.copy_window_blocks])


# ----------------------------------------------------------------- step result
_RESULT_ARRAYS = ("top_ids", "top_logprobs", "score_ids", "score_logprobs", "score_target_logprobs")


def step_result_to_proto(result: StepResult, codec: TensorCodec | None = None,
                         step_id: int = 0) -> worker_pb2.StepResponse:
    codec = _codec(codec)
    codec.begin_message()
    msg = worker_pb2.StepResponse(tokens_computed=int(result.tokens_computed), step_id=step_id)
    _results_to_proto(result.results, msg.results, codec)
    for later in result.later:
        _results_to_proto(later, msg.later.add().results, codec)
    return msg


def _results_to_proto(results: list[SeqResult], out, codec: TensorCodec) -> None:
    for r in results:
        m = out.add()
        m.seq_id = int(r.seq_id)
        m.token_id = int(r.token_id)
        m.logprob = float(r.logprob)
        if r.accepted_ids:
            m.accepted_ids[:] = [int(t) for t in r.accepted_ids]
            m.accepted_logprobs[:] = [float(x) for x in r.accepted_logprobs]
        if r.committed_positions is not None:
            m.committed_positions[:] = [int(p) for p in r.committed_positions]
            m.committed_ids[:] = [int(t) for t in r.committed_ids]
        for name in _RESULT_ARRAYS:
            value = getattr(r, name)
            if value is not None:
                codec.encode_into(value, getattr(m, name))


def _results_from_proto(messages, codec: TensorCodec) -> list[SeqResult]:
    results = []
    for m in messages:
        arrays = {name: codec.decode(getattr(m, name)) if m.HasField(name) else None for name in _RESULT_ARRAYS}
        # a diffusion step that committed nothing reads back as None, which the scheduler takes as none
        committed = (np.array(m.committed_positions, np.int64), np.array(m.committed_ids, np.int64)) \
            if len(m.committed_positions) else (None, None)
        results.append(SeqResult(seq_id=m.seq_id, token_id=m.token_id, logprob=m.logprob,
                                 accepted_ids=list(m.accepted_ids), accepted_logprobs=list(m.accepted_logprobs),
                                 committed_positions=committed[0], committed_ids=committed[1], **arrays))
    return results


def step_result_from_proto(msg: worker_pb2.StepResponse, codec: TensorCodec | None = None) -> StepResult:
    codec = _codec(codec)
    return StepResult(_results_from_proto(msg.results, codec), tokens_computed=msg.tokens_computed,
                      later=[_results_from_proto(s.results, codec) for s in msg.later])
