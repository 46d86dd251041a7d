"""What the gRPC and HTTP front ends share: the model's tokenizer and chat template,
request validation, talking to the scheduler, detokenization and stop strings.

The router holds no tensors: it reads the GGUF's metadata only. A request goes

    prepare_*()  ->  Prepared (prompt ids, SamplingParams, stop strings, echo)
    generate()   ->  async iterator of PromptEvent / DeltaEvent / FinishEvent

Errors a client caused or can act on are raised as ``FrontendError``, which
carries both the HTTP status and the gRPC code, so each front end maps them
the same way.
"""
from __future__ import annotations

import asyncio
import functools
import logging
import time
import uuid
from pathlib import Path
from typing import Any, AsyncIterator

import grpc

from protos.tensorserve.v1 import common_pb2, router_pb2, scheduler_pb2
from router.chat_template import ChatTemplate, ChatTemplateError, ChatTemplateMissing
from router.detokenizer import IncrementalDetokenizer
from router.diffusion_requests import canvas_text
from router.requests import (  # noqa: F401  (re-exported for the front ends)
    CanvasEvent, DeltaEvent, FinishEvent, FrontendError, Prepared, PromptEvent, StopStringMatcher, TokenLogprob, error_from_rpc)
from router.replicas import Replica, ReplicaSet
from router.scheduler_client import SchedulerClient  # noqa: F401  (re-exported)
from router.tokenizer import Tokenizer
from shared.gguf_file import GGUFFile
from shared.model_registry import model_name, resolve_model
from shared.sampling_params import SamplingParams
from shared.step_codec import sampling_params_to_proto

log = logging.getLogger("tensorserve.router")

HEALTH_TIMEOUT_S = 2.0
# a diffusion request's canvas when the client sets no max_tokens (the context would make every
# step a pass over thousands of positions)
DIFFUSION_DEFAULT_MAX_TOKENS = 128
STATS_TIMEOUT_S = 2.0

FINISH_NAMES = {
    common_pb2.FINISH_REASON_STOP: "stop",
    common_pb2.FINISH_REASON_LENGTH: "length",
    common_pb2.FINISH_REASON_ABORT: "abort",
    common_pb2.FINISH_REASON_SCORED: "length",
    common_pb2.FINISH_REASON_ERROR: "error",
}


UNAVAILABLE_RETRY_S = 0.25


async def _first_then(first, call):
    """The event already read (if the stream had one), then the rest of the call's."""
    if first is None:
        return
    yield first
    async for ev in call:
        yield ev


# ----------------------------------------------------------------------------- the model front end
def model_kind(gguf: GGUFFile) -> int:
    """router.proto's ModelKind of a model: diffusion for a non-causal (text-diffusion) architecture
    (shared/model_config.py's `causal`, once the diffusion models are there), else autoregressive."""
    from shared.model_config import ModelConfig
    try:
        causal = getattr(ModelConfig.from_gguf(gguf), "causal", True)
    except Exception:      # an architecture the workers do not run: the worker says so, not the router
        causal = True
    return router_pb2.MODEL_KIND_AUTOREGRESSIVE if causal else router_pb2.MODEL_KIND_DIFFUSION


class Frontend:
    """One served model: tokenizer, chat template, validation, and generation through one of its
    scheduler replicas (router/replicas.py).

    `kind` is the model's ModelKind. A diffusion model's requests carry DiffusionOptions to its
    scheduler, whose stream adds a canvas after every denoising step (CanvasEvent here, router.proto's
    CanvasReplace); its tokens arrive block by block like an autoregressive model's."""

    def __init__(self, model: str, scheduler_addresses: list[str] | str | None, served_model_name: str | None = None,
                 metrics: Any = None, chat_template: str | None = None, internal_token: str | None = None,
                 unavailable_timeout: float = 0.0, routing: str = "prefix-aware"):
        self.model_arg = model
        self.path: Path = resolve_model(model)
        gguf = GGUFFile(self.path)
        md = gguf.metadata
        self.metadata = md
        self.architecture = gguf.architecture
        self.kind = model_kind(gguf)
        self.served_model_name = served_model_name or model_name(model)
        self.tokenizer = Tokenizer.from_metadata(md)
        self.mask_token_id = int(md.get("tokenizer.ggml.mask_token_id", -1))
        self.chat_template: ChatTemplate | None
        self.chat_template_error: str | None = None
        try:
            self.chat_template = (ChatTemplate.from_file(chat_template, self.tokenizer) if chat_template
                                  else ChatTemplate.from_metadata(md, self.tokenizer))
        except ChatTemplateMissing as exc:
            if self.kind == router_pb2.MODEL_KIND_DIFFUSION:   # as llama-diffusion-cli --chat does
                self.chat_template = ChatTemplate.chatml(self.tokenizer)
            else:
                self.chat_template = None
                self.chat_template_error = str(exc)
        except ChatTemplateError as exc:
            self.chat_template = None
            self.chat_template_error = str(exc)
        self.gguf_context = int(md.get(f"{self.architecture}.context_length", 0) or 0)
        self._max_context: int | None = None       # from the scheduler's Stats (KV-capped), when known
        try:
            from shared.model_config import model_fingerprint
            self.fingerprint = model_fingerprint(gguf)   # a few KB sampled from the mmap, no tensors kept
        except Exception:  # pragma: no cover - fingerprint is informative only
            self.fingerprint = ""
        del gguf
        self.created = int(self.path.stat().st_mtime)
        if isinstance(scheduler_addresses, str):
            scheduler_addresses = [scheduler_addresses]
        self.replicas = (ReplicaSet(self.served_model_name, scheduler_addresses, internal_token, routing)
                         if scheduler_addresses else None)
        self.unavailable_timeout = unavailable_timeout
        self.metrics = metrics

    # ------------------------------------------------------------------ model facts
    @property
    def max_context(self) -> int:
        return self._max_context or self.gguf_context

    async def refresh_max_context(self) -> int:
        if self._max_context is None and self.replicas is not None:
            for replica in self.replicas.replicas:
                try:
                    stats = await replica.client.stats(timeout=STATS_TIMEOUT_S)
                except grpc.RpcError:
                    continue
                if stats.max_context:
                    self._max_context = int(stats.max_context)
                    break
        return self.max_context

    def note_stats(self, stats: scheduler_pb2.StatsResponse) -> None:
        if stats.max_context:
            self._max_context = int(stats.max_context)

    def check_model(self, model: str | None) -> None:
        if model and model not in (self.served_model_name,):
            raise FrontendError(f"the model '{model}' does not exist here; this server serves "
                                f"'{self.served_model_name}'", 404, code="model_not_found", param="model")

    # ------------------------------------------------------------------ tokens
    def token_logprob(self, token_id: int, logprob: float | None,
                      top_ids=(), top_logprobs=()) -> TokenLogprob:
        b = self.tokenizer.token_bytes(token_id)
        top = [(int(t), self.token_str(int(t)), self.tokenizer.token_bytes(int(t)), float(lp))
               for t, lp in zip(top_ids, top_logprobs)]
        return TokenLogprob(token_id, b.decode("utf-8", errors="replace"), b, logprob, top)

    def token_str(self, token_id: int) -> str:
        return self.tokenizer.token_bytes(token_id).decode("utf-8", errors="replace")

    def encode_completion(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special=True, parse_special=False)

    def render_chat(self, messages: list[dict]) -> str:
        if self.chat_template is None:
            raise FrontendError(self.chat_template_error or "this model has no chat template", 400,
                                code="chat_template_missing", param="messages")
        try:
            return self.chat_template.render(messages, add_generation_prompt=True)
        except ChatTemplateError as exc:
            raise FrontendError(str(exc), 400, code="invalid_messages", param="messages") from None

    def encode_chat(self, messages: list[dict]) -> tuple[list[int], str]:
        text = self.render_chat(messages)
        return self.tokenizer.encode(text, add_special=False, parse_special=True), text

    def check_token_ids(self, ids: list[int], param: str = "prompt") -> list[int]:
        n = self.tokenizer.vocab_size
        for t in ids:
            if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < n:
                raise FrontendError(f"token id {t!r} is outside the vocabulary (0..{n - 1})", 400,
                                    code="invalid_token", param=param)
        return list(ids)

    # ------------------------------------------------------------------ validation
    @staticmethod
    def make_params(**kwargs: Any) -> SamplingParams:
        clean = {k: v for k, v in kwargs.items() if v is not None}
        try:
            params = SamplingParams(**clean)
            params.validate()
        except (ValueError, TypeError) as exc:
            msg = str(exc)
            param = msg.split(" ", 1)[0] if msg else None
            raise FrontendError(msg, 400, code="invalid_value", param=param) from None
        return params

    async def check_prompt_length(self, prompt_ids: list[int], max_tokens: int | None = None) -> None:
        """The prompt fits, with at least one token to generate; with `max_tokens`, both fit (vLLM's
        rule: a request the context cannot finish is refused, naming both numbers)."""
        if not prompt_ids:
            raise FrontendError("the prompt is empty (no tokens); send some text", 400,
                                code="invalid_prompt", param="prompt")
        m = await self.refresh_max_context()
        if m and len(prompt_ids) >= m:
            raise FrontendError(f"prompt has {len(prompt_ids)} tokens but the context holds {m} "
                                "(at least one must be left to generate); shorten the prompt",
                                400, code="context_length_exceeded", param="prompt")
        if m and max_tokens is not None and len(prompt_ids) + max_tokens > m:
            raise FrontendError(f"this model's context holds {m} tokens, but {len(prompt_ids) + max_tokens} "
                                f"were requested ({len(prompt_ids)} in the prompt, {max_tokens} for the "
                                f"completion); lower max_tokens to at most {m - len(prompt_ids)} or shorten "
                                "the prompt", 400, code="context_length_exceeded", param="max_tokens")

    @property
    def is_diffusion(self) -> bool:
        return self.kind == router_pb2.MODEL_KIND_DIFFUSION

    def default_max_tokens(self, prompt_ids: list[int]) -> int:
        """max_tokens when a chat request sets none: what the context leaves (a diffusion model's
        canvas: at most DIFFUSION_DEFAULT_MAX_TOKENS)."""
        left = max(1, self.max_context - len(prompt_ids))
        return min(left, DIFFUSION_DEFAULT_MAX_TOKENS) if self.is_diffusion else left

    @staticmethod
    def new_request_id(prefix: str = "req") -> str:
        return f"{prefix}-{uuid.uuid4().hex}"

    # ------------------------------------------------------------------ generation
    async def generate(self, p: Prepared) -> AsyncIterator[PromptEvent | DeltaEvent | FinishEvent]:
        """Stream one request through the scheduler.

        Raises FrontendError when the scheduler refuses the request before its
        first event; a failure after that ends the stream with a FinishEvent
        whose error is set. Closing the iterator early cancels the Submit call,
        which aborts the sequence upstream.
        """
        if self.replicas is None:
            raise FrontendError("the router has no scheduler to send requests to (start it with --scheduler)",
                                503, code="unavailable")
        req = scheduler_pb2.SubmitRequest(request_id=p.request_id, prompt_token_ids=p.prompt_ids,
                                          eos_token_ids=sorted(self.tokenizer.eos_ids))
        sampling_params_to_proto(p.params, req.sampling)
        if p.prompt_logprobs is not None:
            req.prompt_logprobs = p.prompt_logprobs
        if p.speculative is not None:
            req.speculative = p.speculative
        if self.is_diffusion:
            req.diffusion.SetInParent()
            if p.diffusion is not None:
                req.diffusion.CopyFrom(p.diffusion)
        metrics = self.metrics
        t0 = time.perf_counter()
        t_last: float | None = None
        detok = IncrementalDetokenizer(self.tokenizer)
        stops = StopStringMatcher(p.stop)
        want_lp = p.params.logprobs is not None
        completion_tokens = 0
        first = True
        # a scheduler or worker that is restarting (UNAVAILABLE before any event) is waited for, up to
        # --unavailable-timeout: the request has produced nothing yet, so trying again loses nothing
        # (another replica of the model, when one serves, is tried first)
        deadline = time.monotonic() + self.unavailable_timeout
        tried: set[int] = set()
        while True:
            replica, hit_blocks = self.replicas.choose(p.prompt_ids, tried)
            replica.in_flight += 1
            call = replica.client.submit(req)
            try:
                async for ev in call:
                    break
                else:
                    ev = None
                break
            except BaseException as exc:      # refused, or this request cancelled (client gone)
                replica.in_flight -= 1
                if not isinstance(exc, grpc.RpcError):
                    call.cancel()
                    raise
                if exc.code() != grpc.StatusCode.UNAVAILABLE or time.monotonic() >= deadline:
                    raise error_from_rpc(exc) from None
                tried.add(replica.index)
                if len(tried) >= len(self.replicas):
                    tried.clear()
                    await asyncio.sleep(UNAVAILABLE_RETRY_S)
        if metrics is not None:
            metrics.routed(replica, hit_blocks > 0)
        try:
            try:
                async for ev in _first_then(ev, call):
                    if first:
                        first = False
                        if p.echo:
                            lps = None
                            if p.prompt_logprobs is not None:
                                lps = [self.token_logprob(p.prompt_ids[0], None)]
                                for te in ev.prompt_logprobs:
                                    lps.append(self.token_logprob(te.token_id, te.logprob, te.top_ids,
                                                                  te.top_logprobs))
                            text = (p.prompt_text if p.prompt_text is not None
                                    else self.tokenizer.decode(p.prompt_ids))
                            yield PromptEvent(list(p.prompt_ids), text, lps)
                    if ev.HasField("canvas"):
                        ids = list(ev.canvas.token_ids)
                        yield CanvasEvent(ids, int(ev.canvas.step), functools.partial(canvas_text, self))
                    if ev.tokens:
                        now = time.perf_counter()
                        if metrics is not None:
                            if t_last is None:
                                metrics.ttft.observe(now - t0)
                            else:
                                metrics.itl.observe((now - t_last) / len(ev.tokens))
                        t_last = now
                        ids, lps, text = [], [] if want_lp else None, []
                        for te in ev.tokens:
                            ids.append(te.token_id)
                            if lps is not None:
                                lps.append(self.token_logprob(te.token_id, te.logprob, te.top_ids,
                                                              te.top_logprobs))
                            text.append(detok.feed(te.token_id))
                        completion_tokens += len(ids)
                        if metrics is not None:
                            metrics.generation_tokens.inc(len(ids))
                        out = stops.push("".join(text))
                        yield DeltaEvent(ids, out, lps)
                        if stops.matched is not None:
                            call.cancel()
                            yield FinishEvent("stop", len(p.prompt_ids), completion_tokens,
                                              stop=stops.matched, proto_reason=common_pb2.FINISH_REASON_STOP)
                            return
                    if ev.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED:
                        tail = stops.push(detok.flush())
                        if stops.matched is None:
                            tail += stops.flush()
                        if tail:
                            yield DeltaEvent([], tail, [] if want_lp else None)
                        reason = ev.finish_reason
                        if stops.matched is not None:
                            reason = common_pb2.FINISH_REASON_STOP
                        err = None
                        if reason == common_pb2.FINISH_REASON_ERROR:
                            d = ev.error
                            code = d.code or "internal_error"
                            err = FrontendError(d.message or "generation failed in the scheduler",
                                                503 if "unavailable" in code else 500,
                                                code=code, param=d.param or None)
                        usage = ev.usage
                        yield FinishEvent(FINISH_NAMES.get(reason, "stop"), len(p.prompt_ids),
                                          completion_tokens, cached_tokens=int(usage.cached_tokens),
                                          stop=stops.matched, error=err, proto_reason=reason)
                        return
            except grpc.RpcError as exc:
                err = error_from_rpc(exc)
                if first:
                    raise err from None
                yield FinishEvent("error", len(p.prompt_ids), completion_tokens, error=err,
                                  proto_reason=common_pb2.FINISH_REASON_ERROR)
                return
            # the stream ended without a finish event
            err = FrontendError("the scheduler ended the stream without finishing the request", 503,
                                code="unavailable")
            if first:
                raise err
            yield FinishEvent("error", len(p.prompt_ids), completion_tokens, error=err,
                              proto_reason=common_pb2.FINISH_REASON_ERROR)
        finally:
            replica.in_flight -= 1
            if not call.done():
                call.cancel()

    async def collect(self, p: Prepared) -> tuple[PromptEvent | None, list[DeltaEvent], FinishEvent]:
        """Run a request to completion (non-streamed APIs)."""
        prompt, deltas, finish = None, [], None
        async for ev in self.generate(p):
            if isinstance(ev, PromptEvent):
                prompt = ev
            elif isinstance(ev, DeltaEvent):
                deltas.append(ev)
            else:
                finish = ev
        assert finish is not None
        return prompt, deltas, finish

    # ------------------------------------------------------------------ health
    async def health(self) -> tuple[bool, str, list]:
        """(serving, message, components) of the model: serving while one replica serves; the
        components of every replica (a replica's message says which)."""
        if self.replicas is None:
            return False, "the router has no scheduler configured (--scheduler)", []
        results = await asyncio.gather(*(self.replica_health(r) for r in self.replicas.replicas))
        ok = any(r[0] for r in results)
        messages = [m for serving, m, _ in results if not serving and m]
        components = [c for _, _, comps in results for c in comps]
        return ok, "; ".join(messages), components

    async def replica_health(self, replica: Replica) -> tuple[bool, str, list]:
        """One replica's (serving, message, components), never waiting past its deadline."""
        where = "" if len(self.replicas) == 1 else f" (replica {replica.index} of {self.served_model_name})"
        try:
            h = await replica.client.stats(timeout=HEALTH_TIMEOUT_S)
        except grpc.RpcError as exc:
            return False, error_from_rpc(exc).message + where, []
        except asyncio.TimeoutError:
            return False, f"the scheduler at {replica.address} did not answer in time{where}", []
        self.note_stats(h)
        ok = h.status == common_pb2.SERVING_STATUS_SERVING
        msg = h.status_message
        if not ok and not msg:
            bad = [f"{c.name}: {c.message or 'not serving'}" for c in h.components
                   if c.status != common_pb2.SERVING_STATUS_SERVING]
            msg = "; ".join(bad) or "the scheduler is not serving"
        return ok, msg + (where if msg else ""), list(h.components)

    async def close(self) -> None:
        if self.replicas is not None:
            await self.replicas.close()
