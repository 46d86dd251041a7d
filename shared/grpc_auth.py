"""Metadata tokens on gRPC servers: the router's API key on its public port, and the internal
token that scheduler and worker require on every RPC when they are told to have one, so nothing
reaches them around the router's key. The standard health service stays open: probes carry no
key. A refused call ends with UNAUTHENTICATED and a message that says which setting to use."""
from __future__ import annotations

import hmac
from typing import Iterable

import grpc

from shared.grpc_health import SERVICE_NAME as HEALTH_SERVICE

INTERNAL_TOKEN_KEY = "x-tensorserve-internal-token"
OPEN_METHODS = (f"/{HEALTH_SERVICE}/Check", f"/{HEALTH_SERVICE}/Watch")


def internal_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    """What a client of the scheduler or worker sends with every call."""
    return ((INTERNAL_TOKEN_KEY, token),) if token else ()


def _denying(handler: grpc.RpcMethodHandler, message: str, asynchronous: bool) -> grpc.RpcMethodHandler:
    """A handler of the same streaming kind as `handler` that refuses the call."""
    code = grpc.StatusCode.UNAUTHENTICATED
    streaming_in, streaming_out = handler.request_streaming, handler.response_streaming
    if asynchronous:
        if streaming_out:
            async def deny(request, context):
                await context.abort(code, message)
                yield  # pragma: no cover
        else:
            async def deny(request, context):
                await context.abort(code, message)
    elif streaming_out:
        def deny(request, context):
            context.abort(code, message)
            yield  # pragma: no cover
    else:
        def deny(request, context):
            context.abort(code, message)
    make = {(False, False): grpc.unary_unary_rpc_method_handler, (False, True): grpc.unary_stream_rpc_method_handler,
            (True, False): grpc.stream_unary_rpc_method_handler, (True, True): grpc.stream_stream_rpc_method_handler}
    return make[(streaming_in, streaming_out)](deny)


class _Token:
    def __init__(self, key: str, expected: str, message: str, open_methods: Iterable[str] = OPEN_METHODS):
        self.key, self.expected, self.message = key, expected.encode(), message
        self.open = frozenset(open_methods)

    def allows(self, details: grpc.HandlerCallDetails) -> bool:
        if details.method in self.open:
            return True
        got = dict(details.invocation_metadata or ()).get(self.key, "")
        return hmac.compare_digest(got.encode() if isinstance(got, str) else got, self.expected)


class TokenInterceptor(_Token, grpc.ServerInterceptor):
    """For `grpc.server` (the worker)."""

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None or self.allows(handler_call_details):
            return handler
        return _denying(handler, self.message, asynchronous=False)


class AsyncTokenInterceptor(_Token, grpc.aio.ServerInterceptor):
    """For `grpc.aio.server` (router and scheduler)."""

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or self.allows(handler_call_details):
            return handler
        return _denying(handler, self.message, asynchronous=True)


def api_key_interceptor(api_key: str) -> AsyncTokenInterceptor:
    return AsyncTokenInterceptor("authorization", f"Bearer {api_key}",
                                 "missing or wrong API key: send metadata 'authorization: Bearer <key>' with the key "
                                 "the server was started with (--api-key / TS_API_KEY)")


_INTERNAL_MESSAGE = (f"missing or wrong internal token: internal calls carry metadata '{INTERNAL_TOKEN_KEY}' with "
                     "the --internal-token (TS_INTERNAL_TOKEN) this process was started with; give router, scheduler "
                     "and worker the same one")


def internal_interceptor(token: str, asynchronous: bool) -> grpc.ServerInterceptor:
    cls = AsyncTokenInterceptor if asynchronous else TokenInterceptor
    return cls(INTERNAL_TOKEN_KEY, token, _INTERNAL_MESSAGE)
