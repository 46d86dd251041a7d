"""The standard gRPC health service (`grpc.health.v1.Health`) that router, scheduler and worker
serve, registered for "" (the whole server) and for each of the server's own services, so that
probes (Kubernetes, compose, grpc_health_probe, load balancers) need nothing of ours.

SERVING only once the process can do its work, NOT_SERVING while it drains or has lost the
process behind it. It answers without the API key: probes carry none.
"""
from __future__ import annotations

from typing import Iterable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio

SERVICE_NAME = health.SERVICE_NAME          # "grpc.health.v1.Health"
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class _Reporter:
    def __init__(self, servicer, server, services: Iterable[str]):
        self.servicer = servicer
        self.names = ("", *services)
        self.serving: bool | None = None
        health_pb2_grpc.add_HealthServicer_to_server(servicer, server)


class HealthReporter(_Reporter):
    """For a `grpc.Server` (thread pool)."""

    def __init__(self, server: grpc.Server, services: Iterable[str], serving: bool = False):
        super().__init__(health.HealthServicer(), server, services)
        self.set(serving)

    def set(self, serving: bool) -> None:
        if serving != self.serving:
            self.serving = serving
            for name in self.names:
                self.servicer.set(name, SERVING if serving else NOT_SERVING)

    def shutdown(self) -> None:
        """NOT_SERVING for good (draining): later `set` calls are ignored."""
        self.serving = False
        self.servicer.enter_graceful_shutdown()


class AsyncHealthReporter(_Reporter):
    """For a `grpc.aio.Server`."""

    def __init__(self, server: grpc.aio.Server, services: Iterable[str]):
        super().__init__(health_aio.HealthServicer(), server, services)

    async def set(self, serving: bool) -> None:
        if serving != self.serving:
            self.serving = serving
            for name in self.names:
                await self.servicer.set(name, SERVING if serving else NOT_SERVING)

    async def shutdown(self) -> None:
        self.serving = False
        await self.servicer.enter_graceful_shutdown()


def check(address: str, service: str = "", timeout: float = 5.0) -> bool:
    """True when the server at `address` answers SERVING for `service` (a client's probe)."""
    with grpc.insecure_channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service),
                                                              timeout=timeout)
        except grpc.RpcError:
            return False
    return reply.status == SERVING
