"""Diffusion requests through the scheduler's gRPC service: a Submit becomes a served diffusion
request, the batcher runs as the engine loop's engine, and each step's progress becomes
SubmitEvents (the whole canvas, and the tokens of blocks that became final).

A served request's canvas is `sampling.max_tokens` long, rounded up so that prompt + canvas is a
multiple of the block length (llama.cpp's layout). Tokens reach the client block by block, in
order; the request ends early, without running later blocks, when a final block holds an
end-of-generation or stop token (finish "stop", the token not sent) or reaches max_tokens
(finish "length").
"""
from __future__ import annotations

import random

import grpc

from protos.tensorserve.v1 import scheduler_pb2
from scheduler.diffusion.batcher import DiffusionBatcher
from scheduler.diffusion.request import DiffusionRequest
from scheduler.events import FINISH, usage
from scheduler.handles import SubmitRefused
from shared.diffusion_params import DiffusionParams
from shared.sampling_params import SamplingParams

DEFAULT_BLOCK_LENGTH = 32
DEFAULT_ALGORITHM = "confidence"


class ServedDiffusionRequest(DiffusionRequest):
    """A DiffusionRequest with what serving adds: the client's token budget and end tokens, and
    how far its blocks are final."""
    num_cached_tokens = 0                    # no prefix cache for non-causal passes (usage reports it)

    def setup(self, max_tokens: int, end_ids: frozenset[int]) -> "ServedDiffusionRequest":
        self.max_tokens, self.end_ids = max_tokens, end_ids
        self.final_tokens: list[int] = []    # the output that is final and will be sent, in order
        self.stop_reason: str | None = None  # set when a final block ends the request early
        self.on_block = self._block_final
        return self

    def _block_final(self, _request, start: int, tokens: list[int]) -> None:
        if self.stop_reason is not None:
            return
        for t in tokens:
            if t in self.end_ids:
                self.stop_reason = "stop"
                return
            self.final_tokens.append(t)
            if len(self.final_tokens) >= self.max_tokens:
                self.stop_reason = "length"
                return


def diffusion_request(request: scheduler_pb2.SubmitRequest, params: SamplingParams, description,
                      seq_id: int) -> ServedDiffusionRequest:
    """The served request of a validated prompt and sampling params; SubmitRefused
    (INVALID_ARGUMENT) names what does not fit."""
    def refuse(message: str) -> SubmitRefused:
        return SubmitRefused(grpc.StatusCode.INVALID_ARGUMENT, message)

    prompt = [int(t) for t in request.prompt_token_ids]
    if request.HasField("prompt_logprobs") or params.logprobs is not None:
        raise refuse("logprobs are not available for a text-diffusion model: leave logprobs and echo's "
                     "prompt logprobs unset")
    for name in ("repetition_penalty", "presence_penalty", "frequency_penalty", "min_p"):
        if getattr(params, name) != getattr(SamplingParams, name):
            raise refuse(f"{name} is not supported by text-diffusion models: leave it unset")
    o = request.diffusion
    block = int(o.block_length) if o.HasField("block_length") else DEFAULT_BLOCK_LENGTH
    if block <= 0:
        raise refuse(f"diffusion.block_length must be > 0 (got {block})")
    # llama.cpp's layout: the prompt and the canvas together fill whole blocks
    gen = params.max_tokens + (-(len(prompt) + params.max_tokens)) % block
    limit = int(description.max_context)
    if len(prompt) + gen > limit:
        raise refuse(f"the prompt's {len(prompt)} tokens and a canvas of {gen} (max_tokens {params.max_tokens} "
                     f"rounded up to whole blocks of {block}) exceed the context of {limit}; lower max_tokens "
                     "or diffusion.block_length, or shorten the prompt")
    n_blocks = (len(prompt) + gen) // block
    algorithm = o.algorithm if o.HasField("algorithm") else DEFAULT_ALGORITHM
    kwargs = dict(gen_length=gen, block_length=block, algorithm=algorithm,
                  steps=int(o.steps) if o.HasField("steps") else n_blocks * block,   # one token a step
                  temperature=params.temperature, top_k=max(0, params.top_k), top_p=params.top_p,
                  seed=params.seed if params.seed is not None else random.getrandbits(31))
    if o.HasField("threshold"):
        kwargs["threshold"] = o.threshold
    if o.HasField("gamma"):
        kwargs["gamma"] = o.gamma
    try:
        dparams = DiffusionParams(**kwargs)
        dparams.validate(len(prompt))
    except ValueError as exc:    # its messages name the CLI's flags: the API's names are diffusion.*
        raise refuse(_api_names(str(exc))) from None
    end_ids = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos
                                                 else frozenset(int(t) for t in request.eos_token_ids))
    mask = int(description.mask_token_id)
    return ServedDiffusionRequest(prompt, dparams, mask, seq_id=seq_id).setup(params.max_tokens, end_ids)


def _api_names(message: str) -> str:
    for flag, name in (("--gen-length", "max_tokens"), ("--steps", "diffusion.steps"),
                       ("--block-length", "diffusion.block_length"), ("--algorithm", "diffusion.algorithm"),
                       ("--threshold", "diffusion.threshold"), ("--gamma", "diffusion.gamma"),
                       ("--temperature", "temperature"), ("--top-k", "top_k"), ("--top-p", "top_p")):
        message = message.replace(flag, name)
    return message


class DiffusionEngine(DiffusionBatcher):
    """The batcher with the face the engine loop (scheduler/core.py) expects of an engine."""

    def __init__(self, execute, max_context: int, max_num_seqs: int, max_num_batched_tokens: int):
        super().__init__(execute, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens)
        self.max_context = max_context
        self.preempted: list = []
        self.checkpoints = None
        self._progressed: list[ServedDiffusionRequest] = []

    def add(self, request: ServedDiffusionRequest) -> None:
        request.on_step = self._note_progress
        super().add(request)

    def _note_progress(self, request: ServedDiffusionRequest) -> None:
        self._progressed.append(request)

    def abort(self, seq_id: int) -> None:                       # type: ignore[override]
        for r in [*self.waiting, *self.running]:
            if r.seq_id == seq_id:
                super().abort(r)
                return

    def has_work(self) -> bool:
        return self.has_unfinished()

    def step(self) -> list[ServedDiffusionRequest]:             # type: ignore[override]
        """One forward; the requests it moved on (each once), those ended by a final block included."""
        self._progressed = []
        super().step()
        for r in self._progressed:
            if r.stop_reason is not None and not r.finished:
                r.finish_reason = r.stop_reason
                super().abort(r)          # leaves the batch now: its later blocks are not needed
            elif r.finished and r.stop_reason is not None:
                r.finish_reason = r.stop_reason
        return list(dict.fromkeys(self._progressed))


def diffusion_stats(engine: DiffusionEngine) -> scheduler_pb2.StatsResponse:
    s = scheduler_pb2.StatsResponse()
    if engine is not None:
        s.running, s.waiting, s.max_context = len(engine.running), len(engine.waiting), engine.max_context
    return s


def diffusion_progress_event(request: ServedDiffusionRequest, handle) -> scheduler_pb2.SubmitEvent | None:
    """The canvas after this step, the final tokens the client has not had yet, and the finish."""
    ev = scheduler_pb2.SubmitEvent()
    ev.canvas.token_ids[:] = request.output
    ev.canvas.step = request.steps_taken
    ev.canvas.mask_token_id = request.mask_token_id
    for t in request.final_tokens[handle.emitted:]:
        ev.tokens.add(token_id=int(t))
    handle.emitted = len(request.final_tokens)
    if request.finished:
        reason = request.finish_reason if request.finish_reason in FINISH else "stop"
        ev.finish_reason = FINISH[reason]
        u = usage(request)
        u.completion_tokens, u.total_tokens = handle.emitted, len(request.prompt) + handle.emitted
        ev.usage.CopyFrom(u)
        handle.done = True
    return ev


__all__ = ["DiffusionEngine", "ServedDiffusionRequest", "diffusion_request",
           "diffusion_stats", "diffusion_progress_event"]
