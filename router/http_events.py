"""The HTTP handlers' view of a generation (router/http_api.py): the frontend's events, cut for
echo-only scoring, its first event read before the response starts (so a refusal is an HTTP
status), and the end of the work when the client disconnects."""
from __future__ import annotations

import asyncio
import contextlib

from fastapi import Request

from router.frontend import DeltaEvent, FinishEvent, Frontend, FrontendError, Prepared


class ClientDisconnected(FrontendError):
    def __init__(self) -> None:
        super().__init__("the client closed the connection", 499, code="client_disconnected")


async def _disconnected(request: Request) -> None:
    """Returns when the client has gone (the body is read by then, so only http.disconnect comes)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def events(frontend: Frontend, p: Prepared, request: Request | None = None):
    """frontend.generate, with echo-only scoring (echo + max_tokens 0) cut after the prompt. A
    client that disconnects (streamed or not, before its first token or after) ends the
    generation at once: closing `frontend.generate` cancels the scheduler call, which aborts the
    sequence at the next step boundary and frees its blocks."""
    score_only = getattr(p, "score_only", False)
    agen = frontend.generate(p)
    watcher = asyncio.ensure_future(_disconnected(request)) if request is not None else None
    step = None
    try:
        while True:
            step = asyncio.ensure_future(agen.__anext__())
            if watcher is not None:
                await asyncio.wait({step, watcher}, return_when=asyncio.FIRST_COMPLETED)
                if not step.done():
                    raise ClientDisconnected()
            try:
                ev = await step
            except StopAsyncIteration:
                return
            if score_only and isinstance(ev, DeltaEvent):
                continue
            if score_only and isinstance(ev, FinishEvent) and ev.error is None:
                ev.completion_tokens = 0
                ev.finish_reason = "length"
            yield ev
    finally:                 # the client left, or the response was cancelled: stop the pending read first
        if watcher is not None:
            watcher.cancel()
        if step is not None and not step.done():
            step.cancel()
            with contextlib.suppress(BaseException):
                await step
        await agen.aclose()


async def prime(gen):
    """The first event, so that a refusal before any output becomes an HTTP error status."""
    try:
        return await gen.__anext__()
    except FrontendError:
        await gen.aclose()
        raise
    except StopAsyncIteration:  # pragma: no cover - generate always ends with a FinishEvent
        raise FrontendError("the scheduler sent nothing", 503, code="unavailable") from None


async def chain(first, gen):
    yield first
    async for ev in gen:
        yield ev
