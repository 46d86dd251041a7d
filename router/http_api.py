"""The OpenAI-compatible HTTP API (FastAPI), over router.frontend.

Endpoints: POST /v1/completions, POST /v1/chat/completions (streamed as SSE
with a final ``data: [DONE]``, or not), GET /v1/models, GET /health,
GET /metrics. Errors use OpenAI's shape ``{"error": {"message", "type",
"param", "code"}}``.
"""
from __future__ import annotations

import hmac
import logging
import time
from typing import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from router import openapi_schemas as schemas
from router import openai_shapes as oa
from router import request_limits as limits
from router.frontend import CanvasEvent, DeltaEvent, FinishEvent, FrontendError, Prepared, PromptEvent
from router.http_events import ClientDisconnected, chain, events, prime
from router.metrics import CONTENT_TYPE_LATEST, RouterMetrics
from router.diffusion_requests import check_diffusion
from router.model_table import ModelTable
from router.status import health_report, scrape_stats
from protos.tensorserve.v1.router_pb2 import MODEL_KIND_DIFFUSION as DIFFUSION
from shared.sampling_params import MAX_LOGPROBS

log = logging.getLogger("tensorserve.router.http")

_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


_ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/models")




# ----------------------------------------------------------------------------- the app
def create_app(models: ModelTable, metrics: RouterMetrics, api_key: str | None = None,
               protect_metrics: bool = False) -> FastAPI:
    app = FastAPI(title="TensorServe", docs_url=None, redoc_url=None, openapi_url="/openapi.json")
    app.state.models = models
    expected = f"Bearer {api_key}".encode() if api_key else None

    @app.middleware("http")
    async def auth(request: Request, call_next):
        path = request.url.path
        if expected is not None and (path.startswith("/v1") or (protect_metrics and path in ("/health", "/metrics"))):
            got = request.headers.get("authorization", "").encode()
            if not hmac.compare_digest(got, expected):
                metrics.count(path if path in _ENDPOINTS else "other", 401)
                return JSONResponse({"error": {
                    "message": "missing or wrong API key: send the header 'Authorization: Bearer <key>' "
                               "with the key the server was started with (--api-key / TS_API_KEY)",
                    "type": "invalid_request_error", "param": None, "code": "invalid_api_key"}},
                    status_code=401)
        return await call_next(request)

    @app.exception_handler(StarletteHTTPException)
    async def http_exc(request: Request, exc: StarletteHTTPException):
        return JSONResponse({"error": {"message": f"{request.method} {request.url.path}: {exc.detail}",
                                       "type": "invalid_request_error", "param": None, "code": None}},
                            status_code=exc.status_code)

    @app.exception_handler(FrontendError)
    async def fe_exc(request: Request, exc: FrontendError):
        return oa.error(exc)

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception):     # a bug of ours: still OpenAI's shape, and logged
        log.exception("%s %s failed", request.method, request.url.path)
        return JSONResponse({"error": {"message": f"internal error ({type(exc).__name__}); the router's log has "
                                                  "the details", "type": "server_error", "param": None,
                                       "code": "internal_error"}}, status_code=500)

    async def read_json(request: Request) -> dict:
        limits.check_content_type(request.headers.get("content-type"))
        declared = request.headers.get("content-length")
        if declared and declared.isdigit():
            limits.check_size(int(declared))         # before reading a byte of it
        raw = bytearray()
        async for part in request.stream():
            raw += part
            limits.check_size(len(raw))
        return limits.parse_json_body(bytes(raw))

    # ------------------------------------------------------------------ /v1/completions
    async def prepare_completion(body: dict) -> tuple[Prepared, bool, bool]:
        frontend = models.get(body.get("model"))
        oa.check_n(body)
        if body.get("suffix"):
            raise oa.bad("suffix is not supported by this server", "suffix", code="unsupported_value")
        stream = oa.get_bool(body, "stream")
        include_usage = oa.stream_options(body, stream)
        echo = oa.get_bool(body, "echo")
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, str):
            ids, text = frontend.encode_completion(prompt), prompt
        elif isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            ids, text = frontend.check_token_ids(prompt), None
        elif isinstance(prompt, list) and len(prompt) > 1:
            raise oa.bad("batched prompts are not supported: send one prompt per request", "prompt",
                       code="unsupported_value")
        else:
            raise oa.bad("prompt must be a string or a list of token ids", "prompt")
        logprobs = body.get("logprobs")
        if logprobs is not None and (not isinstance(logprobs, int) or isinstance(logprobs, bool)
                                     or not 0 <= logprobs <= MAX_LOGPROBS):
            raise oa.bad(f"logprobs must be an integer in [0, {MAX_LOGPROBS}], got {logprobs!r}", "logprobs")
        max_tokens = body.get("max_tokens", 16)
        score_only = echo and max_tokens == 0
        params = frontend.make_params(max_tokens=1 if score_only else max_tokens, logprobs=logprobs,
                                      **oa.common_sampling(body))
        await frontend.check_prompt_length(ids, None if score_only else params.max_tokens)
        diffusion = oa.diffusion_options(body)
        check_diffusion(frontend, diffusion, params)
        p = Prepared(frontend.new_request_id("cmpl"), ids, text, params, oa.get_stop(body), echo=echo,
                     prompt_logprobs=logprobs if echo else None, endpoint="completions",
                     speculative=oa.speculative(body), frontend=frontend, diffusion=diffusion)
        p.score_only = score_only  # type: ignore[attr-defined]
        return p, stream, include_usage

    async def begin(request: Request, prepare):
        """Parse and validate a request, then start its generation: (prepared, stream?, usage?, events, first event)."""
        p, stream, include_usage = await prepare(await read_json(request))
        metrics.prompt_tokens.inc(len(p.prompt_ids))
        gen = events(p.frontend, p, request)
        return p, stream, include_usage, gen, await prime(gen)

    @app.post("/v1/completions", openapi_extra=schemas.body(schemas.COMPLETION_REQUEST))
    async def completions(request: Request):
        t0 = time.perf_counter()
        endpoint = "/v1/completions"
        created = int(time.time())
        try:
            p, stream, include_usage, gen, first = await begin(request, prepare_completion)
        except FrontendError as exc:
            metrics.count(endpoint, exc.status)
            return oa.error(exc)
        model = p.frontend.served_model_name

        def chunk(text: str, lp: dict | None, finish: str | None) -> dict:
            return {"id": p.request_id, "object": "text_completion", "created": created, "model": model,
                    "choices": [{"index": 0, "text": text, "logprobs": lp, "finish_reason": finish}]}

        want_lp = p.params.logprobs is not None
        if not stream:
            texts, lp_all, finish = [], None, None
            lpc = oa.CompletionLogprobs()
            try:
                async for ev in chain(first, gen):
                    if isinstance(ev, (PromptEvent, DeltaEvent)):
                        texts.append(ev.text)
                        if want_lp:
                            lp_all = lpc.merge(lp_all, lpc.add(ev.logprobs or []))
                        elif lpc is not None:
                            lpc.offset += len(ev.text)
                    else:
                        finish = ev
            finally:
                await gen.aclose()
            if finish.error is not None:
                metrics.count(endpoint, finish.error.status)
                return oa.error(finish.error)
            metrics.count(endpoint, 200)
            metrics.e2e.observe(time.perf_counter() - t0)
            out = chunk("".join(texts), lp_all if want_lp else None, oa.finish_reason(finish))
            out["usage"] = oa.usage(finish)
            return JSONResponse(out)

        async def sse() -> AsyncIterator[bytes]:
            lpc = oa.CompletionLogprobs()
            status = 200
            try:
                async for ev in chain(first, gen):
                    if isinstance(ev, (PromptEvent, DeltaEvent)):
                        lp = lpc.add(ev.logprobs or []) if want_lp else None
                        if ev.text or (lp and lp["tokens"]):
                            yield oa.sse(chunk(ev.text, lp, None))
                    elif isinstance(ev, CanvasEvent):
                        yield oa.canvas_sse(chunk("", None, None), ev)
                    elif ev.error is not None:
                        status = ev.error.status
                        yield oa.sse(ev.error.to_openai())
                    else:
                        yield oa.sse(chunk("", None, oa.finish_reason(ev)))
                        if include_usage:
                            yield oa.sse({"id": p.request_id, "object": "text_completion", "created": created,
                                        "model": model, "choices": [], "usage": oa.usage(ev)})
                yield oa.DONE
            except ClientDisconnected:
                status = 499             # nginx's 'client closed request'
            finally:
                await gen.aclose()
                metrics.count(endpoint, status)
                metrics.e2e.observe(time.perf_counter() - t0)

        return StreamingResponse(sse(), media_type="text/event-stream", headers=_SSE_HEADERS)

    # ------------------------------------------------------------------ /v1/chat/completions
    def parse_messages(body: dict) -> list[dict]:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise oa.bad("messages must be a non-empty list of {role, content} objects", "messages")
        out = []
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise oa.bad(f"messages[{i}] must be an object with a string 'role'", "messages")
            limits.check_role(m["role"], i)
            content = m.get("content")
            if content is None:
                content = ""
            elif isinstance(content, list):
                parts = []
                for part in content:
                    if isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
                        parts.append(part["text"])
                    else:
                        raise oa.bad(f"messages[{i}].content: only text parts are supported", "messages")
                content = "".join(parts)
            elif not isinstance(content, str):
                raise oa.bad(f"messages[{i}].content must be a string or a list of text parts", "messages")
            msg = dict(m)
            msg["content"] = content
            out.append(msg)
        return out

    async def prepare_chat(body: dict) -> tuple[Prepared, bool, bool]:
        frontend = models.get(body.get("model"))
        oa.check_n(body)
        stream = oa.get_bool(body, "stream")
        include_usage = oa.stream_options(body, stream)
        messages = parse_messages(body)
        want_lp = oa.get_bool(body, "logprobs")
        top = body.get("top_logprobs")
        if top is not None:
            if not isinstance(top, int) or isinstance(top, bool) or not 0 <= top <= MAX_LOGPROBS:
                raise oa.bad(f"top_logprobs must be an integer in [0, {MAX_LOGPROBS}], got {top!r}", "top_logprobs")
            if not want_lp:
                raise oa.bad("top_logprobs needs logprobs set to true", "top_logprobs")
        ids, text = frontend.encode_chat(messages)
        await frontend.check_prompt_length(ids)
        max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
        asked = max_tokens is not None
        if max_tokens is None:
            max_tokens = frontend.default_max_tokens(ids)
        params = frontend.make_params(max_tokens=max_tokens, logprobs=(top or 0) if want_lp else None,
                                      **oa.common_sampling(body))
        if asked:
            await frontend.check_prompt_length(ids, params.max_tokens)
        diffusion = oa.diffusion_options(body)
        check_diffusion(frontend, diffusion, params)
        p = Prepared(frontend.new_request_id("chatcmpl"), ids, text, params, oa.get_stop(body), endpoint="chat",
                     speculative=oa.speculative(body), frontend=frontend, diffusion=diffusion)
        return p, stream, include_usage

    @app.post("/v1/chat/completions", openapi_extra=schemas.body(schemas.CHAT_COMPLETION_REQUEST))
    async def chat_completions(request: Request):
        t0 = time.perf_counter()
        endpoint = "/v1/chat/completions"
        created = int(time.time())
        try:
            p, stream, include_usage, gen, first = await begin(request, prepare_chat)
        except FrontendError as exc:
            metrics.count(endpoint, exc.status)
            return oa.error(exc)
        model = p.frontend.served_model_name
        want_lp = p.params.logprobs is not None

        if not stream:
            texts, lps, finish = [], [], None
            try:
                async for ev in chain(first, gen):
                    if isinstance(ev, DeltaEvent):
                        texts.append(ev.text)
                        if want_lp:
                            lps.extend(ev.logprobs or [])
                    elif isinstance(ev, FinishEvent):
                        finish = ev
            finally:
                await gen.aclose()
            if finish.error is not None:
                metrics.count(endpoint, finish.error.status)
                return oa.error(finish.error)
            metrics.count(endpoint, 200)
            metrics.e2e.observe(time.perf_counter() - t0)
            return JSONResponse({
                "id": p.request_id, "object": "chat.completion", "created": created, "model": model,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": "".join(texts)},
                             "logprobs": {"content": oa.chat_logprobs(lps), "refusal": None} if want_lp else None,
                             "finish_reason": oa.finish_reason(finish)}],
                "usage": oa.usage(finish)})

        def chunk(delta: dict, lp: list | None, finish: str | None) -> dict:
            return {"id": p.request_id, "object": "chat.completion.chunk", "created": created, "model": model,
                    "choices": [{"index": 0, "delta": delta,
                                 "logprobs": {"content": lp, "refusal": None} if lp is not None else None,
                                 "finish_reason": finish}]}

        async def sse() -> AsyncIterator[bytes]:
            status = 200
            try:
                yield oa.sse(chunk({"role": "assistant", "content": ""}, None, None))
                async for ev in chain(first, gen):
                    if isinstance(ev, DeltaEvent):
                        lp = oa.chat_logprobs(ev.logprobs or []) if want_lp else None
                        if ev.text or lp:
                            yield oa.sse(chunk({"content": ev.text}, lp, None))
                    elif isinstance(ev, CanvasEvent):
                        yield oa.canvas_sse(chunk({}, None, None), ev)
                    elif isinstance(ev, FinishEvent):
                        if ev.error is not None:
                            status = ev.error.status
                            yield oa.sse(ev.error.to_openai())
                        else:
                            yield oa.sse(chunk({}, None, oa.finish_reason(ev)))
                            if include_usage:
                                yield oa.sse({"id": p.request_id, "object": "chat.completion.chunk",
                                            "created": created, "model": model, "choices": [],
                                            "usage": oa.usage(ev)})
                yield oa.DONE
            except ClientDisconnected:
                status = 499             # nginx's 'client closed request'
            finally:
                await gen.aclose()
                metrics.count(endpoint, status)
                metrics.e2e.observe(time.perf_counter() - t0)

        return StreamingResponse(sse(), media_type="text/event-stream", headers=_SSE_HEADERS)

    # ------------------------------------------------------------------ models, health, metrics
    @app.get("/v1/models")
    async def list_models():
        metrics.count("/v1/models", 200)
        return {"object": "list", "data": [{
            "id": f.served_model_name, "object": "model", "created": f.created, "owned_by": "tensorserve",
            "max_model_len": f.max_context, "architecture": f.architecture,
            "kind": "diffusion" if f.kind == DIFFUSION else "autoregressive"} for f in models]}

    @app.get("/health")
    async def health():
        ok, body = await health_report(models, metrics.supervisor_status)
        metrics.count("/health", 200 if ok else 503)
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics_endpoint():
        await scrape_stats(models, metrics)
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return app
