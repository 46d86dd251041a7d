"""The scheduler's side of the worker contract: Describe, and Step as an engine executor.

``WorkerClient.step`` has the ``Executor`` signature of scheduler/engine.py
(``StepRequest -> StepResult``): it encodes the batch with a ``TensorCodec``
(shared memory when the worker is on this host, inline bytes otherwise), makes
one blocking Step call and decodes the answer. It is used from one thread (the
engine loop): the codec and its arena are not thread-safe, and a shared-memory
request stays valid only until the next request is encoded.

Any failure of the call (worker killed: UNAVAILABLE; hung: DEADLINE_EXCEEDED;
a refused batch) raises ``WorkerFailure`` with a message that names the
worker's address and says what to do.
"""
from __future__ import annotations

import logging
import os
import socket
import time
from typing import Callable

import grpc

from protos.tensorserve.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from shared.tensor_codec import TensorCodec, resolve_transport
from shared.step import StepRequest, StepResult
from shared.step_codec import step_request_to_proto, step_result_from_proto

log = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 256 * 2**20
TRANSPORT_METADATA_KEY = "ts-tensor-transport"   # what we want back; read by worker/server.py
DEFAULT_STEP_TIMEOUT_S = 600.0
# A step running longer than this makes the client ask the worker's Health (served by other
# threads than Step): a worker that answers is busy and is waited for, one that does not is
# hung or stopped and fails the step now instead of at the step timeout.
HEALTH_PROBE_AFTER_S = float(os.environ.get("TS_WORKER_PROBE_AFTER_S", "10"))
HEALTH_PROBE_TIMEOUT_S = 3.0


class WorkerFailure(RuntimeError):
    """A Describe or Step call failed; ``code`` is the gRPC status code when there was one."""

    def __init__(self, message: str, code: grpc.StatusCode | None = None):
        super().__init__(message)
        self.code = code


def _rpc_error_text(exc: grpc.RpcError) -> str:
    code = exc.code() if hasattr(exc, "code") else None
    details = exc.details() if hasattr(exc, "details") else str(exc)
    name = code.name if code is not None else "ERROR"
    return f"{name}: {details}"


class WorkerClient:
    def __init__(self, address: str, transport: str | None = None,
                 step_timeout_s: float = DEFAULT_STEP_TIMEOUT_S):
        self.address = address
        self.setting = transport
        self.step_timeout_s = step_timeout_s
        self.channel = grpc.insecure_channel(address, options=[
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.enable_retries", 0),
        ])
        self.stub = worker_pb2_grpc.WorkerStub(self.channel)
        self.transport = resolve_transport(transport, address)
        self.codec: TensorCodec | None = None
        self._codecs: list[TensorCodec] = []
        self.description: worker_pb2.DescribeResponse | None = None
        self._step_id = 0

    def describe(self, timeout_s: float = 5.0) -> worker_pb2.DescribeResponse:
        """Ask the worker for its capacity; picks the tensor transport from its hostname."""
        try:
            d = self.stub.Describe(worker_pb2.DescribeRequest(), timeout=timeout_s, wait_for_ready=False)
        except grpc.RpcError as exc:
            raise WorkerFailure(f"worker {self.address} did not answer Describe: {_rpc_error_text(exc)}",
                                exc.code() if hasattr(exc, "code") else None) from None
        # auto: shared memory only when the worker really is on this host
        setting = (self.setting or "").strip().lower() or None
        if self.transport == "shm" and setting in (None, "auto") and d.hostname \
                and d.hostname != socket.gethostname():
            self.transport = "inline"
        for codec in self._codecs:
            codec.close()
        self._codecs = [TensorCodec(self.transport), TensorCodec(self.transport)]
        self.codec = self._codecs[0]
        self.description = d
        return d

    def step(self, request: StepRequest) -> StepResult:
        return self.submit(request)()

    __call__ = step

    def submit(self, request: StepRequest) -> Callable[[], StepResult]:
        """Send a step without waiting; the returned callable waits for its result. Two steps may
        be in flight: consecutive steps encode into alternate shared-memory arenas, so sending
        one never overwrites the tensors of the one before, which the worker may not have read."""
        if self.codec is None:
            raise WorkerFailure(f"worker {self.address} was not described yet")
        step_id = self._step_id + 1          # the worker runs steps in this order: no id may be skipped
        codec = self._codecs[step_id % 2]
        t0 = time.perf_counter()
        msg = step_request_to_proto(request, codec, step_id=step_id)
        try:
            future = self.stub.Step.future(msg, timeout=self.step_timeout_s,
                                           metadata=((TRANSPORT_METADATA_KEY, self.transport),))
        except grpc.RpcError as exc:
            raise self._failure(exc) from None
        self._step_id = step_id

        def wait() -> StepResult:
            while True:
                try:
                    response = future.result(timeout=HEALTH_PROBE_AFTER_S)
                    break
                except grpc.FutureTimeoutError:
                    if not self._answers_health():
                        future.cancel()
                        raise WorkerFailure(
                            f"worker {self.address} stopped answering: step {step_id} has run "
                            f"{time.perf_counter() - t0:.0f} s and Health got no reply within "
                            f"{HEALTH_PROBE_TIMEOUT_S:.0f} s (is it hung or stopped? restart the worker)") from None
                except grpc.RpcError as exc:
                    raise self._failure(exc) from None
            if log.isEnabledFor(logging.DEBUG):
                log.debug("Step %d: result read %.2f ms after it was sent", step_id,
                          (time.perf_counter() - t0) * 1e3)
            try:
                return step_result_from_proto(response, codec)
            except (ValueError, OSError) as exc:
                raise WorkerFailure(f"worker {self.address} sent a step result that cannot be read: {exc} "
                                    f"(restart the worker)") from None
        return wait

    def _answers_health(self) -> bool:
        try:
            self.stub.Health(common_pb2.HealthRequest(), timeout=HEALTH_PROBE_TIMEOUT_S)
            return True
        except grpc.RpcError:
            return False

    def _failure(self, exc: grpc.RpcError) -> WorkerFailure:
        return WorkerFailure(f"worker {self.address} failed: {_rpc_error_text(exc)} (restart the worker)",
                             exc.code() if hasattr(exc, "code") else None)

    def close(self) -> None:
        try:
            self.channel.close()
        finally:
            for codec in self._codecs:
                codec.close()
            self._codecs = []
            self.codec = None
