"""Requests that cannot be decoded (a corrupt wire format, invalid UTF-8 in a string field) end
with INVALID_ARGUMENT and a plain message, not grpcio's UNKNOWN/INTERNAL with a Python
exception's text. One interceptor per server kind (asyncio and thread pool) wraps each method's
request deserializer: a message that does not parse becomes a marker, and the method's handler
refuses the marker before the servicer sees anything."""
from __future__ import annotations

import contextlib
from typing import Any, Callable

import grpc


class _Undecodable:
    def __init__(self, message: str):
        self.message = message


def _safe(deserializer: Callable[[bytes], Any] | None, method: str) -> Callable[[bytes], Any] | None:
    if deserializer is None:
        return None
    owner = getattr(getattr(deserializer, "__self__", None), "DESCRIPTOR", None)
    name = owner.full_name if owner is not None else "the request message"
    text = (f"{method}: the request is not a valid {name} (a corrupt protobuf wire format, or a string "
            "field that is not valid UTF-8); send a message encoded from the service's .proto")

    def deserialize(data: bytes) -> Any:
        try:
            return deserializer(data)
        except Exception:   # DecodeError, or RuntimeError from upb for some malformed inputs
            return _Undecodable(text)
    return deserialize


def _wrap(handler: grpc.RpcMethodHandler | None, method: str, asynchronous: bool) -> grpc.RpcMethodHandler | None:
    if handler is None:
        return None
    deserialize = _safe(handler.request_deserializer, method)
    code = grpc.StatusCode.INVALID_ARGUMENT
    if handler.unary_unary or handler.unary_stream:
        behavior = handler.unary_unary or handler.unary_stream
        if asynchronous:
            if handler.unary_unary:
                async def unary(request, context):
                    if isinstance(request, _Undecodable):
                        await context.abort(code, request.message)
                    return await behavior(request, context)
            else:
                async def unary(request, context):
                    if isinstance(request, _Undecodable):
                        await context.abort(code, request.message)
                    async with contextlib.aclosing(behavior(request, context)) as responses:
                        async for item in responses:     # closed at once on cancel: its cleanup runs now
                            yield item
        else:
            def unary(request, context):
                if isinstance(request, _Undecodable):
                    context.abort(code, request.message)
                return behavior(request, context)
        field = "unary_unary" if handler.unary_unary else "unary_stream"
        return handler._replace(request_deserializer=deserialize, **{field: unary})

    behavior = handler.stream_unary or handler.stream_stream
    field = "stream_unary" if handler.stream_unary else "stream_stream"
    if asynchronous:
        async def checked_async(requests, context):
            async for request in requests:
                if isinstance(request, _Undecodable):
                    await context.abort(code, request.message)
                yield request

        if handler.stream_stream:
            async def streaming(requests, context):
                async with contextlib.aclosing(behavior(checked_async(requests, context), context)) as responses:
                    async for item in responses:
                        yield item
        else:
            async def streaming(requests, context):
                return await behavior(checked_async(requests, context), context)
    else:
        def checked(requests, context):
            for request in requests:
                if isinstance(request, _Undecodable):
                    context.abort(code, request.message)
                yield request

        def streaming(requests, context):
            return behavior(checked(requests, context), context)
    return handler._replace(request_deserializer=deserialize, **{field: streaming})


class DecodeErrorInterceptor(grpc.ServerInterceptor):
    """For `grpc.server` (the worker)."""

    def intercept_service(self, continuation, handler_call_details):
        return _wrap(continuation(handler_call_details), handler_call_details.method, asynchronous=False)


class AsyncDecodeErrorInterceptor(grpc.aio.ServerInterceptor):
    """For `grpc.aio.server` (router and scheduler)."""

    async def intercept_service(self, continuation, handler_call_details):
        return _wrap(await continuation(handler_call_details), handler_call_details.method, asynchronous=True)
