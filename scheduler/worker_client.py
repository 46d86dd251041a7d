"""The scheduler's side of the worker contract: Describe, and Step as an engine executor.

``WorkerClient.step`` has the ``Executor`` signature of scheduler/engine.py
(``StepRequest -> StepResult``): it encodes the batch with a ``TensorCodec``
(shared memory when the worker is on this host, inline bytes otherwise), sends
it and decodes the answer. Steps travel over one long-lived ``StepStream``
(a message costs the two processes about half the CPU of a unary call:
~370 us against ~820 us per round trip, measured on 2 cores). It is used from
one thread (the engine loop): the codec and its arena are not thread-safe, and
a shared-memory request stays valid only until the next-but-one request is
encoded.

Any failure (worker killed: UNAVAILABLE; a refused batch: INVALID_ARGUMENT)
raises ``WorkerFailure`` with a message that names the worker's address and
says what to do. A step running longer than ``HEALTH_PROBE_AFTER_S`` makes a
watchdog thread ask the worker's Health (served by other threads than steps):
a worker that answers is busy and is waited for, one that does not is hung or
stopped, and the step fails now instead of at the step timeout.
"""
from __future__ import annotations

import logging
import queue
import socket
import threading
import time
from typing import Callable

import grpc
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc

from protos.tensorserve.v1 import worker_pb2, worker_pb2_grpc
from shared.grpc_auth import internal_metadata
from shared.tensor_codec import TensorCodec, resolve_transport
from shared.step import StepRequest, StepResult
from shared.step_codec import step_request_to_proto, step_result_from_proto

log = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 256 * 2**20
TRANSPORT_METADATA_KEY = "ts-tensor-transport"   # what we want back; read by worker/server.py
DEFAULT_STEP_TIMEOUT_S = 600.0
HEALTH_PROBE_AFTER_S = 10.0      # --worker-probe-after
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
                 step_timeout_s: float = DEFAULT_STEP_TIMEOUT_S, probe_after_s: float = HEALTH_PROBE_AFTER_S,
                 internal_token: str | None = None):
        self.address = address
        self.metadata = internal_metadata(internal_token)
        self.probe_after_s = probe_after_s
        self.setting = transport
        self.step_timeout_s = step_timeout_s
        self.channel = grpc.insecure_channel(address, options=[
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.enable_retries", 0),
        ])
        self.stub = worker_pb2_grpc.WorkerStub(self.channel)
        self.health_stub = health_pb2_grpc.HealthStub(self.channel)   # the standard grpc.health.v1 service
        self.transport = resolve_transport(transport, address)
        self.codec: TensorCodec | None = None
        self._codecs: list[TensorCodec] = []
        self._import_codec: TensorCodec | None = None
        self.description: worker_pb2.DescribeResponse | None = None
        self._step_id = 0
        self._stream = None                  # the StepStream call, opened by the first step
        self._outbox: queue.SimpleQueue | None = None      # the stream's requests (None ends it)
        self._answers: dict[int, worker_pb2.StepResponse] = {}   # read ahead of their wait
        self._waiting_since: float | None = None
        self._hung_message = ""
        self._closed = threading.Event()
        self._watchdog: threading.Thread | None = None

    def describe(self, timeout_s: float = 5.0) -> worker_pb2.DescribeResponse:
        """Ask the worker for its capacity; picks the tensor transport from its hostname."""
        try:
            d = self.stub.Describe(worker_pb2.DescribeRequest(), timeout=timeout_s, wait_for_ready=False,
                                  metadata=self.metadata)
        except grpc.RpcError as exc:
            raise WorkerFailure(f"worker {self.address} did not answer Describe: {_rpc_error_text(exc)}",
                                exc.code() if hasattr(exc, "code") else None) from None
        # auto: shared memory only when the worker really is on this host
        setting = (self.setting or "").strip().lower() or None
        if self.transport == "shm" and setting in (None, "auto") and d.hostname \
                and d.hostname != socket.gethostname():
            self.transport = "inline"
        for codec in self._codecs + ([self._import_codec] if self._import_codec else []):
            codec.close()
        self._codecs, self._import_codec = [TensorCodec(self.transport), TensorCodec(self.transport)], None
        self.codec = self._codecs[0]
        self.description = d
        return d

    def step(self, request: StepRequest) -> StepResult:
        return self.submit(request)()

    __call__ = step

    def submit(self, request: StepRequest) -> Callable[[], StepResult]:
        """Send a step without waiting; the returned callable waits for its result. Two steps may
        be in flight (their waits are called in the order they were sent): consecutive steps
        encode into alternate shared-memory arenas, so sending one never overwrites the tensors
        of the one before, which the worker may not have read."""
        if self.codec is None:
            raise WorkerFailure(f"worker {self.address} was not described yet")
        if self._stream is None:
            self._open_stream()
        step_id = self._step_id + 1          # the worker runs steps in this order: no id may be skipped
        codec = self._codecs[step_id % 2]
        t0 = time.perf_counter()
        self._outbox.put(step_request_to_proto(request, codec, step_id=step_id))
        self._step_id = step_id

        def wait() -> StepResult:
            response = self._read(step_id)
            if log.isEnabledFor(logging.DEBUG):
                log.debug("Step %d: result read %.2f ms after it was sent", step_id,
                          (time.perf_counter() - t0) * 1e3)
            try:
                return step_result_from_proto(response, codec)
            except (ValueError, OSError) as exc:
                raise WorkerFailure(f"worker {self.address} sent a step result that cannot be read: {exc} "
                                    f"(restart the worker)") from None
        return wait

    def _open_stream(self) -> None:
        self._outbox = queue.SimpleQueue()
        self._stream = self.stub.StepStream(iter(self._outbox.get, None),
                                            metadata=((TRANSPORT_METADATA_KEY, self.transport), *self.metadata))
        self._answers = {}
        self._hung_message = ""
        if self._watchdog is None:
            self._watchdog = threading.Thread(target=self._watch, name="worker-watchdog", daemon=True)
            self._watchdog.start()

    def _read(self, step_id: int) -> worker_pb2.StepResponse:
        """The answer to `step_id`; answers come in the order steps were sent."""
        while step_id not in self._answers:
            if self._stream is None:
                raise WorkerFailure(f"worker {self.address}: the step stream failed before step {step_id} "
                                    f"was answered (restart the worker)")
            self._waiting_since = time.monotonic()
            try:
                response = next(self._stream)
            except StopIteration:
                self._stream = None
                raise WorkerFailure(f"worker {self.address} closed the step stream (restart the worker)") from None
            except grpc.RpcError as exc:
                self._stream = None
                if self._hung_message:
                    raise WorkerFailure(self._hung_message) from None
                raise self._failure(exc) from None
            finally:
                self._waiting_since = None
            self._answers[response.step_id] = response
        return self._answers.pop(step_id)

    def _watch(self) -> None:
        """Cancels the stream of a worker that runs a step past the probe delay and answers no Health."""
        period = max(0.05, min(1.0, self.probe_after_s / 4))
        probed_at = 0.0
        while not self._closed.wait(period):
            since, stream = self._waiting_since, self._stream
            if since is None or stream is None:
                continue
            now = time.monotonic()
            waited = now - since
            if waited > self.step_timeout_s:
                self._hung_message = (f"worker {self.address} ran one step for over {self.step_timeout_s:.0f} s "
                                      f"(the step timeout); restart the worker")
            elif waited > self.probe_after_s and now - probed_at > self.probe_after_s:
                probed_at = now
                if self._answers_health():
                    continue
                self._hung_message = (
                    f"worker {self.address} stopped answering: step {self._step_id} has run {waited:.0f} s "
                    f"and Health got no reply within {HEALTH_PROBE_TIMEOUT_S:.0f} s "
                    f"(is it hung or stopped? restart the worker)")
            else:
                continue
            stream.cancel()

    def _answers_health(self) -> bool:
        try:
            self.health_stub.Check(health_pb2.HealthCheckRequest(), timeout=HEALTH_PROBE_TIMEOUT_S)
            return True
        except grpc.RpcError:
            return False

    # ------------------------------------------------------------------ KV blocks (prefix checkpoints)
    def export_blocks(self, block_ids: list[int], timeout_s: float = 60.0,
                      window_ids: list[int] | None = None) -> np.ndarray:
        """A copy of the blocks' K/V: [blocks, layers, 2, kv_heads, block_size, width] (block i's
        slice is its stored payload); `window_ids`: the same blocks in the windowed layers' pool."""
        try:
            reply = self.stub.ExportBlocks(worker_pb2.ExportBlocksRequest(
                blocks=worker_pb2.BlockRange(block_ids=block_ids),
                window_blocks=worker_pb2.BlockRange(block_ids=window_ids or [])), timeout=timeout_s,
                metadata=((TRANSPORT_METADATA_KEY, self.transport), *self.metadata))
        except grpc.RpcError as exc:
            raise self._failure(exc) from None
        reader = TensorCodec("inline")
        try:
            return reader.decode(reply.kv).copy()
        finally:
            reader.close()

    def import_blocks(self, block_ids: list[int], payloads: list, dtype, shape: tuple[int, ...],
                      timeout_s: float = 60.0, window_ids: list[int] | None = None) -> None:
        """Writes blocks' K/V, given as their stored payloads in order (the block-major array of
        `shape`), into the pool's `block_ids`. One shared-memory arena is kept for imports: a
        restore writes into memory the worker has already mapped."""
        if self._import_codec is None:
            self._import_codec = TensorCodec(self.transport)
        codec = self._import_codec
        codec.begin_message()
        try:
            self.stub.ImportBlocks(worker_pb2.ImportBlocksRequest(
                blocks=worker_pb2.BlockRange(block_ids=block_ids), kv=codec.encode_parts(payloads, dtype, shape),
                window_block_ids=window_ids or []),
                timeout=timeout_s, metadata=self.metadata)
        except grpc.RpcError as exc:
            raise self._failure(exc) from None

    def _failure(self, exc: grpc.RpcError) -> WorkerFailure:
        return WorkerFailure(f"worker {self.address} failed: {_rpc_error_text(exc)} (restart the worker)",
                             exc.code() if hasattr(exc, "code") else None)

    def close(self) -> None:
        self._closed.set()
        if self._stream is not None:
            self._outbox.put(None)           # ends the request iterator: the worker's handler returns
        try:
            self.channel.close()
        finally:
            for codec in self._codecs + ([self._import_codec] if self._import_codec else []):
                codec.close()
            self._codecs, self._import_codec = [], None
            self.codec = None
