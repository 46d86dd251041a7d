"""The router's request and event types: FrontendError (an error with both its HTTP status and
its gRPC code), the events a generation streams, a prepared request, and stop-string matching."""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Callable

import grpc

from protos.tensorserve.v1 import common_pb2
from shared.sampling_params import SamplingParams


# ----------------------------------------------------------------------------- errors
class FrontendError(Exception):
    """An error reported to the client: HTTP status, gRPC code and OpenAI error fields."""

    def __init__(self, message: str, status: int = 400, code: str | None = None, param: str | None = None,
                 grpc_code: grpc.StatusCode | None = None, type: str | None = None):
        super().__init__(message)
        self.message = message
        self.status = status
        self.code = code
        self.param = param
        self.grpc_code = grpc_code or _GRPC_FOR_STATUS.get(status, grpc.StatusCode.INTERNAL)
        self.type = type or _TYPE_FOR_STATUS.get(status, "server_error")

    def to_openai(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def to_detail(self) -> common_pb2.ErrorDetail:
        return common_pb2.ErrorDetail(code=self.code or self.type, message=self.message, param=self.param or "")


_GRPC_FOR_STATUS = {
    400: grpc.StatusCode.INVALID_ARGUMENT, 401: grpc.StatusCode.UNAUTHENTICATED,
    404: grpc.StatusCode.NOT_FOUND, 413: grpc.StatusCode.INVALID_ARGUMENT, 415: grpc.StatusCode.INVALID_ARGUMENT,
    429: grpc.StatusCode.RESOURCE_EXHAUSTED, 499: grpc.StatusCode.CANCELLED,
    501: grpc.StatusCode.UNIMPLEMENTED, 503: grpc.StatusCode.UNAVAILABLE, 504: grpc.StatusCode.DEADLINE_EXCEEDED,
}
_TYPE_FOR_STATUS = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                    413: "invalid_request_error", 415: "invalid_request_error", 499: "client_disconnected",
                    429: "rate_limit_error", 501: "not_implemented_error", 503: "service_unavailable",
                    504: "timeout_error"}


def error_from_rpc(exc: grpc.RpcError, what: str = "scheduler") -> FrontendError:
    """Map a scheduler RPC failure to what the client sees."""
    code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
    details = (exc.details() if hasattr(exc, "details") else None) or str(exc)
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        ctx = "context" in details and "prompt" in details
        return FrontendError(details, 400, code="context_length_exceeded" if ctx else "invalid_argument",
                             param="prompt" if ctx else None)
    if code == grpc.StatusCode.NOT_FOUND:
        return FrontendError(details, 404, code="model_not_found", param="model")
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return FrontendError(details, 429, code="resource_exhausted")
    if code == grpc.StatusCode.UNAVAILABLE:
        return FrontendError(f"the {what} is unavailable: {details}", 503, code="unavailable")
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return FrontendError(f"the {what} did not answer in time: {details}", 503, code="unavailable")
    if code == grpc.StatusCode.CANCELLED:
        return FrontendError(f"the {what} cancelled the request: {details}", 503, code="cancelled")
    return FrontendError(f"the {what} failed ({code.name}): {details}", 500, code="internal_error")


# ----------------------------------------------------------------------------- events
@dataclass
class TokenLogprob:
    token_id: int
    token: str
    token_bytes: bytes
    logprob: float | None
    top: list[tuple[int, str, bytes, float]] = field(default_factory=list)


@dataclass
class PromptEvent:
    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprob] | None


@dataclass
class DeltaEvent:
    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprob] | None


@dataclass
class CanvasEvent:
    """Text diffusion: the whole canvas after the prompt after a denoising step (masked positions
    shown as the mask token's text); it replaces the canvas sent before. The text is rendered on
    first read: a non-streamed request never reads it."""
    token_ids: list[int]
    step: int
    render: Callable[[list[int]], str]

    @functools.cached_property
    def text(self) -> str:
        return self.render(self.token_ids)


@dataclass
class FinishEvent:
    finish_reason: str            # "stop", "length", "abort", "error"
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    stop: str | None = None
    error: FrontendError | None = None
    proto_reason: int = common_pb2.FINISH_REASON_UNSPECIFIED


@dataclass
class Prepared:
    request_id: str
    prompt_ids: list[int]
    prompt_text: str | None
    params: SamplingParams
    stop: list[str]
    echo: bool = False
    prompt_logprobs: int | None = None       # top-k at prompt positions (echo with logprobs)
    endpoint: str = "generate"
    speculative: bool | None = None          # False: no speculative decoding for this request
    frontend: object = None                  # the model's Frontend (router/model_table.py)
    diffusion: object = None                 # common_pb2.DiffusionOptions sent with the request, if any


# ----------------------------------------------------------------------------- stop strings
class StopStringMatcher:
    """Applies stop strings to streamed text, holding back what may begin one.

    ``push(text)`` returns the text safe to emit and whether a stop string
    matched (the stop string and what follows are dropped). ``flush()`` gives
    what was held back once generation ends without a match.
    """

    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self._pending = ""
        self.matched: str | None = None

    def push(self, text: str) -> str:
        if self.matched is not None:
            return ""
        if not self.stops:
            return text
        pending = self._pending + text
        best = None
        for s in self.stops:
            i = pending.find(s)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        if best is not None:
            self.matched = best[1]
            self._pending = ""
            return pending[:best[0]]
        hold = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(pending)), hold, -1):
                if pending.endswith(s[:k]):
                    hold = k
                    break
        self._pending = pending[len(pending) - hold:] if hold else ""
        return pending[:len(pending) - hold]

    def flush(self) -> str:
        out, self._pending = self._pending, ""
        return out if self.matched is None else ""
