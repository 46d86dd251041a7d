"""OpenAI request fields and response shapes for router/http_api.py: parsing and validating the
sampling fields, usage, finish reasons, logprob layouts, SSE framing and the error shape."""
from __future__ import annotations

import json
from typing import Any

from fastapi.responses import JSONResponse

from protos.tensorserve.v1 import common_pb2
from router.frontend import CanvasEvent, FinishEvent, FrontendError, TokenLogprob
from router.request_limits import check_stop


def error(exc: FrontendError) -> JSONResponse:
    return JSONResponse(exc.to_openai(), status_code=exc.status)


def sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


DONE = b"data: [DONE]\n\n"


# ----------------------------------------------------------------------------- request parsing helpers
def bad(message: str, param: str | None = None, code: str = "invalid_value") -> FrontendError:
    return FrontendError(message, 400, code=code, param=param)


def get_bool(body: dict, name: str, default: bool = False) -> bool:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise bad(f"{name} must be a boolean, got {v!r}", name)
    return v


def get_stop(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        return check_stop([stop] if stop else [])
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        return check_stop([s for s in stop if s])
    raise bad(f"stop must be a string or a list of strings, got {stop!r}", "stop")


def check_n(body: dict) -> None:
    for name in ("n", "best_of"):
        v = body.get(name)
        if v is not None and v != 1:
            raise bad(f"{name}={v!r} is not supported: this server returns one choice per request (n=1); "
                       "send several requests instead", name, code="unsupported_value")


def stream_options(body: dict, stream: bool) -> bool:
    so = body.get("stream_options")
    if so is None:
        return False
    if not isinstance(so, dict):
        raise bad("stream_options must be an object", "stream_options")
    if not stream:
        raise bad("stream_options is only allowed when stream is true", "stream_options")
    v = so.get("include_usage", False)
    if not isinstance(v, bool):
        raise bad("stream_options.include_usage must be a boolean", "stream_options")
    return v


def common_sampling(body: dict) -> dict:
    out = {}
    for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                 "frequency_penalty", "seed"):
        if body.get(name) is not None:
            out[name] = body[name]
    if body.get("ignore_eos") is not None:
        out["ignore_eos"] = body["ignore_eos"]
    if body.get("stop_token_ids") is not None:
        ids = body["stop_token_ids"]
        if not isinstance(ids, list):
            raise bad("stop_token_ids must be a list of token ids", "stop_token_ids")
        out["stop_token_ids"] = tuple(ids)
    lb = body.get("logit_bias")
    if lb:
        raise bad("logit_bias is not supported by this server", "logit_bias", code="unsupported_value")
    return out


def speculative(body: dict) -> bool | None:
    """The extension field `speculative`: false turns speculative decoding off for the request."""
    v = body.get("speculative")
    if v is not None and not isinstance(v, bool):
        raise bad("speculative must be a boolean", "speculative")
    return v


_DIFFUSION_FIELDS = {"steps": int, "block_length": int, "algorithm": str, "threshold": float, "gamma": float}


def diffusion_options(body: dict) -> common_pb2.DiffusionOptions | None:
    """The extension object `diffusion` ({steps, block_length, algorithm, threshold, gamma}) of a
    request to a text-diffusion model; ranges are checked by the scheduler, which knows the prompt."""
    v = body.get("diffusion")
    if v is None:
        return None
    if not isinstance(v, dict):
        raise bad("diffusion must be an object with any of: " + ", ".join(_DIFFUSION_FIELDS), "diffusion")
    out = common_pb2.DiffusionOptions()
    for name, value in v.items():
        kind = _DIFFUSION_FIELDS.get(name)
        if kind is None:
            raise bad(f"diffusion.{name} is not a diffusion option; the options are "
                      + ", ".join(_DIFFUSION_FIELDS), f"diffusion.{name}")
        ok = (isinstance(value, str) if kind is str else
              isinstance(value, int) if kind is int else isinstance(value, (int, float)))
        if not ok or isinstance(value, bool):
            raise bad(f"diffusion.{name} must be {'a string' if kind is str else 'an integer' if kind is int else 'a number'}"
                      f", got {value!r}", f"diffusion.{name}")
        setattr(out, name, value)
    return out


def canvas_sse(chunk: dict, ev: CanvasEvent) -> bytes:
    """A text-diffusion canvas as an SSE event named `canvas`: an ordinary chunk of the stream's kind
    with nothing new in its choice (so an OpenAI client that reads every event sees an empty
    delta) and the canvas in an extension field; EventSource clients see it only by that name."""
    chunk["canvas"] = {"text": ev.text, "token_ids": ev.token_ids, "step": ev.step}
    return b"event: canvas\n" + sse(chunk)


def usage(f: FinishEvent) -> dict:
    u = {"prompt_tokens": f.prompt_tokens, "completion_tokens": f.completion_tokens,
         "total_tokens": f.prompt_tokens + f.completion_tokens,
         "prompt_tokens_details": {"cached_tokens": f.cached_tokens}}   # as OpenAI reports prompt caching
    return u


def finish_reason(f: FinishEvent) -> str:
    return "length" if f.finish_reason == "length" else "stop"


# ----------------------------------------------------------------------------- logprob shapes
class CompletionLogprobs:
    """The legacy completions shape: tokens, token_logprobs, top_logprobs, text_offset."""

    def __init__(self, offset: int = 0):
        self.offset = offset

    def add(self, lps: list[TokenLogprob]) -> dict:
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for lp in lps:
            out["tokens"].append(lp.token)
            out["token_logprobs"].append(lp.logprob)
            out["top_logprobs"].append({t: l for _, t, _, l in lp.top} if lp.logprob is not None else None)
            out["text_offset"].append(self.offset)
            self.offset += len(lp.token)
        return out

    @staticmethod
    def merge(a: dict | None, b: dict) -> dict:
        if a is None:
            return b
        for k in a:
            a[k].extend(b[k])
        return a


def chat_logprobs(lps: list[TokenLogprob]) -> list[dict]:
    return [{"token": lp.token, "logprob": lp.logprob, "bytes": list(lp.token_bytes),
             "top_logprobs": [{"token": t, "logprob": l, "bytes": list(b)} for _, t, b, l in lp.top]}
            for lp in lps]
