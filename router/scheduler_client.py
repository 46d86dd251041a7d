"""The router's side of scheduler.proto, one scheduler, on a grpc.aio channel."""
from __future__ import annotations

import grpc

from protos.tensorserve.v1 import scheduler_pb2, scheduler_pb2_grpc
from shared.grpc_auth import internal_metadata

STATS_TIMEOUT_S = 2.0


class SchedulerClient:
    """The router's side of scheduler.proto, on a grpc.aio channel (created inside the running loop)."""

    def __init__(self, address: str, internal_token: str | None = None):
        self.address = address
        self.metadata = internal_metadata(internal_token)
        self._channel: grpc.aio.Channel | None = None
        self._stub: scheduler_pb2_grpc.SchedulerStub | None = None

    @property
    def stub(self) -> scheduler_pb2_grpc.SchedulerStub:
        if self._stub is None:
            self._channel = grpc.aio.insecure_channel(self.address, options=[
                ("grpc.max_receive_message_length", 64 << 20),
                ("grpc.initial_reconnect_backoff_ms", 200),
                ("grpc.max_reconnect_backoff_ms", 2000),
            ])
            self._stub = scheduler_pb2_grpc.SchedulerStub(self._channel)
        return self._stub

    def submit(self, request: scheduler_pb2.SubmitRequest):
        return self.stub.Submit(request, metadata=self.metadata)

    async def stats(self, timeout: float = STATS_TIMEOUT_S) -> scheduler_pb2.StatsResponse:
        return await self.stub.Stats(scheduler_pb2.StatsRequest(), timeout=timeout, metadata=self.metadata)


    async def abort(self, request_id: str, timeout: float = 2.0) -> None:
        try:
            await self.stub.Abort(scheduler_pb2.AbortRequest(request_id=request_id), timeout=timeout,
                                  metadata=self.metadata)
        except grpc.RpcError:
            pass

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()
            self._channel = self._stub = None
