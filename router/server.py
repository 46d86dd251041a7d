"""The public gRPC ``Generation`` service (router.proto), over router.frontend."""
from __future__ import annotations

import asyncio
import time

import grpc

from protos.tensorserve.v1 import common_pb2, router_pb2, router_pb2_grpc
from router.frontend import CanvasEvent, DeltaEvent, FinishEvent, FrontendError, Prepared, PromptEvent, TokenLogprob
from router.diffusion_requests import check_diffusion
from router.model_table import ModelTable
from router import request_limits as limits
from router.metrics import RouterMetrics
from shared.step_codec import sampling_params_from_proto

def _token_logprob_pb(lp: TokenLogprob) -> router_pb2.TokenLogprob:
    m = router_pb2.TokenLogprob(token_id=lp.token_id, token=lp.token, token_bytes=lp.token_bytes)
    if lp.logprob is not None:
        m.logprob = lp.logprob
    for tid, tok, b, l in lp.top:
        m.top.add(token_id=tid, token=tok, logprob=l, token_bytes=b)
    return m


class GenerationServicer(router_pb2_grpc.GenerationServicer):
    def __init__(self, models: ModelTable, metrics: RouterMetrics):
        self.models = models
        self.metrics = metrics
        self.draining = False      # shutting down: new Generate calls are refused
        self.in_flight = 0

    async def _fail(self, context, endpoint: str, exc: FrontendError):
        self.metrics.count(endpoint, exc.grpc_code.name)
        await context.abort(exc.grpc_code, exc.message)

    # ------------------------------------------------------------------ Generate
    async def _prepare(self, request: router_pb2.GenerateRequest) -> Prepared:
        fe = self.models.get(request.model)
        which = request.WhichOneof("prompt")
        text = None
        if which == "text":
            ids, text = fe.encode_completion(request.text), request.text
        elif which == "token_ids":
            ids = fe.check_token_ids(list(request.token_ids.ids))
        elif which == "chat":
            messages = [{"role": limits.check_role(m.role, i), "content": m.content,
                         **({"name": m.name} if m.name else {})} for i, m in enumerate(request.chat.messages)]
            if not messages:
                raise FrontendError("chat has no messages", 400, code="invalid_messages", param="chat")
            ids, text = fe.encode_chat(messages)
            text = None if not request.echo else text
        else:
            raise FrontendError("set one of text, token_ids or chat as the prompt", 400, param="prompt")
        params = sampling_params_from_proto(request.sampling)
        try:
            params.validate()
        except ValueError as exc:
            raise FrontendError(str(exc), 400, code="invalid_value", param=str(exc).split(" ", 1)[0]) from None
        asked = request.sampling.HasField("max_tokens")
        await fe.check_prompt_length(ids, params.max_tokens if asked else None)
        diffusion = request.diffusion if request.HasField("diffusion") else None
        check_diffusion(fe, diffusion, params)
        return Prepared(request.request_id or fe.new_request_id("gen"), ids, text, params,
                        limits.check_stop([s for s in request.stop if s]), echo=request.echo,
                        prompt_logprobs=params.logprobs if request.echo else None, endpoint="grpc.Generate",
                        frontend=fe, diffusion=diffusion)

    async def Generate(self, request, context):
        endpoint = "grpc.Generate"
        t0 = time.perf_counter()
        if self.draining:
            await self._fail(context, endpoint, FrontendError("the router is shutting down; retry on another "
                                                              "replica or after it restarts", 503,
                                                              code="unavailable"))
            return
        self.in_flight += 1
        try:
            async for out in self._generate(request, context, endpoint, t0):
                yield out
        finally:
            self.in_flight -= 1

    async def _generate(self, request, context, endpoint: str, t0: float):
        try:
            p = await self._prepare(request)
            self.metrics.prompt_tokens.inc(len(p.prompt_ids))
            gen = p.frontend.generate(p)
            first = await gen.__anext__()
        except FrontendError as exc:
            await self._fail(context, endpoint, exc)
            return
        model = p.frontend.served_model_name
        status = "OK"
        task = asyncio.current_task()

        def on_done(ctx) -> None:   # the client cancelled: stop waiting on the scheduler now
            if ctx.cancelled() and task is not None and not task.done():
                task.cancel()

        context.add_done_callback(on_done)
        try:
            ev = first
            while True:
                out = router_pb2.GenerateResponse(request_id=p.request_id, model=model)
                if isinstance(ev, PromptEvent):
                    out.prompt.token_ids.extend(ev.token_ids)
                    out.prompt.text = ev.text
                    for lp in ev.logprobs or []:
                        out.prompt.logprobs.append(_token_logprob_pb(lp))
                elif isinstance(ev, CanvasEvent):
                    out.replace.token_ids.extend(ev.token_ids)
                    out.replace.text = ev.text
                elif isinstance(ev, DeltaEvent):
                    if not ev.token_ids and not ev.text:
                        ev = await gen.__anext__()
                        continue
                    out.delta.token_ids.extend(ev.token_ids)
                    out.delta.text = ev.text
                    for lp in ev.logprobs or []:
                        out.delta.logprobs.append(_token_logprob_pb(lp))
                else:
                    assert isinstance(ev, FinishEvent)
                    out.finish.finish_reason = ev.proto_reason
                    out.finish.usage.prompt_tokens = ev.prompt_tokens
                    out.finish.usage.completion_tokens = ev.completion_tokens
                    out.finish.usage.total_tokens = ev.prompt_tokens + ev.completion_tokens
                    out.finish.usage.cached_tokens = ev.cached_tokens
                    if ev.stop:
                        out.finish.stop = ev.stop
                    if ev.error is not None:
                        out.finish.finish_reason = common_pb2.FINISH_REASON_ERROR
                        out.finish.error.CopyFrom(ev.error.to_detail())
                        status = ev.error.grpc_code.name
                    yield out
                    return
                yield out
                ev = await gen.__anext__()
        except StopAsyncIteration:
            return
        except asyncio.CancelledError:
            status = "CANCELLED"
            raise
        finally:
            await gen.aclose()
            self.metrics.count(endpoint, status)
            self.metrics.e2e.observe(time.perf_counter() - t0)

    # ------------------------------------------------------------------ the rest
    async def Tokenize(self, request, context):
        try:
            fe = self.models.get(request.model)
            which = request.WhichOneof("input")
            if which == "chat":
                messages = [{"role": m.role, "content": m.content, **({"name": m.name} if m.name else {})}
                            for m in request.chat.messages]
                ids, _ = fe.encode_chat(messages)
            else:
                ids = fe.tokenizer.encode(request.text, add_special=request.add_special_tokens, parse_special=False)
        except FrontendError as exc:
            await self._fail(context, "grpc.Tokenize", exc)
            return
        self.metrics.count("grpc.Tokenize", "OK")
        return router_pb2.TokenizeResponse(token_ids=ids, max_context=await fe.refresh_max_context())

    async def Detokenize(self, request, context):
        try:
            fe = self.models.get(request.model)
            ids = fe.check_token_ids(list(request.token_ids), param="token_ids")
        except FrontendError as exc:
            await self._fail(context, "grpc.Detokenize", exc)
            return
        self.metrics.count("grpc.Detokenize", "OK")
        return router_pb2.DetokenizeResponse(text=fe.tokenizer.decode(ids, skip_special=request.skip_special_tokens))

    async def ListModels(self, request, context):
        self.metrics.count("grpc.ListModels", "OK")
        return router_pb2.ListModelsResponse(models=[
            router_pb2.ModelInfo(id=fe.served_model_name, architecture=fe.architecture, fingerprint=fe.fingerprint,
                                 max_context=await fe.refresh_max_context(), vocab_size=fe.tokenizer.vocab_size,
                                 kind=fe.kind, created=fe.created, owned_by="tensorserve")
            for fe in self.models])


def add_to_server(server: grpc.aio.Server, models: ModelTable, metrics: RouterMetrics) -> None:
    router_pb2_grpc.add_GenerationServicer_to_server(GenerationServicer(models, metrics), server)
