"""The worker's gRPC service (protos/tensorserve/v1/worker.proto) over one ModelRunner.

Steps run one at a time on one model thread, in the order the scheduler numbered
them; decoding requests and encoding answers (the shared-memory reader and the
arenas are not thread-safe) happen under one lock.

Tensor transport of a Step response, first match wins:
  1. call metadata ``ts-tensor-transport: shm|inline`` (what the scheduler wants back);
  2. the worker's ``--tensor-transport`` when it is ``shm`` or ``inline``;
  3. ``auto``: shm when the request itself carried a TensorRef or the peer is on this host.
Small arrays go inline either way (TensorCodec.shm_min_bytes). Response refs
point into an arena of this worker, one per peer address, and stay valid until
that peer's next Step is answered.
"""
from __future__ import annotations

import dataclasses
import logging
import queue
import socket
import threading
import time
from collections import OrderedDict
from concurrent import futures

import grpc
import numpy as np

from protos.tensorserve.v1 import worker_pb2, worker_pb2_grpc
from shared.grpc_auth import internal_interceptor
from shared.grpc_errors import DecodeErrorInterceptor
from shared.grpc_health import HealthReporter
from shared.shm import ShmArena, ShmReader
from shared.tensor_codec import TensorCodec, is_local_address
from shared.step import StepRequest
from shared.step_codec import step_request_from_proto, step_result_to_proto
from worker import block_transfer
from worker.model_runner import ModelRunner

log = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 256 * 2**20
TRANSPORT_METADATA_KEY = "ts-tensor-transport"
MAX_PEER_ARENAS = 16
STEP_ORDER_WAIT_S = 5.0

class BadStep(ValueError):
    """A Step request the worker refuses: INVALID_ARGUMENT, the worker stays up."""


class WorkerClosing(RuntimeError):
    """A step that arrived after close(): UNAVAILABLE."""


def new_model_thread() -> futures.ThreadPoolExecutor:
    """The one thread that loads the model and runs every forward."""
    return futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="model")


def peer_host(peer: str) -> str:
    """context.peer() ("ipv4:127.0.0.1:5432", "ipv6:[::1]:5432", "unix:/path") to an address
    shared.tensor_codec.is_local_address understands."""
    if peer.startswith(("ipv4:", "ipv6:")):
        return peer.split(":", 1)[1]
    return peer


WORKER_SERVICE = worker_pb2.DESCRIPTOR.services_by_name["Worker"].full_name


class WorkerServicer(worker_pb2_grpc.WorkerServicer):
    def __init__(self, runner: ModelRunner, model_name: str, backend: str, transport: str = "auto",
                 model_thread: futures.ThreadPoolExecutor | None = None, draft_model_name: str = ""):
        if transport not in ("auto", "shm", "inline"):
            raise ValueError(f"tensor transport must be shm, inline or auto, got {transport!r}")
        self.runner = runner
        self.model_name = model_name
        self.draft_model_name = draft_model_name or (runner.drafter.path.name if runner.drafter is not None else "")
        self.backend = backend
        self.transport = transport
        self.hostname = socket.gethostname()
        self.health: HealthReporter | None = None      # the grpc.health.v1 service, set by start_server
        self._lock = threading.Condition()
        self._transfer_lock = threading.Lock()
        self._last_step_id = 0           # steps run in the order the scheduler numbered them
        self._reader = ShmReader()
        self._decoder = TensorCodec("inline", reader=self._reader)   # decodes refs and inline alike
        self._viewer = TensorCodec("inline", reader=self._reader, copy=False)
        self._inline = TensorCodec("inline")
        self._arenas: OrderedDict[tuple[str, int], ShmArena] = OrderedDict()
        self._closed = False
        self.steps = 0
        self._last_step_end = 0.0
        # Every forward runs on this one thread, whichever RPC thread received the step: the
        # compiled kernels' OpenMP runtime keeps a thread team per launching thread, and as soon
        # as the teams' threads outnumber the cores, libgomp stops spinning between parallel
        # regions and every region pays a futex wake-up (measured: a 16 ms decode step became
        # 26 ms). The runner should have been built on this same thread (see new_model_thread).
        self._model_thread = model_thread or new_model_thread()

    # ------------------------------------------------------------------ helpers
    @staticmethod
    def _asked_transport(context) -> str | None:
        """The transport the peer asked for in its metadata, if any."""
        for key, value in context.invocation_metadata() or ():
            if key == TRANSPORT_METADATA_KEY and str(value).strip().lower() in ("shm", "inline"):
                return str(value).strip().lower()
        return None

    def _response_codec(self, request: worker_pb2.StepRequest, context) -> TensorCodec:
        wanted = self._asked_transport(context)
        if wanted is None:
            if self.transport != "auto":
                wanted = self.transport
            elif any(c.token_ids.HasField("ref") or c.block_table.HasField("ref") for c in request.chunks):
                wanted = "shm"
            else:
                wanted = "shm" if is_local_address(peer_host(context.peer() or "")) else "inline"
        if wanted == "inline":
            return self._inline
        # consecutive steps answer through alternate arenas: with a step pipelined behind this
        # one, the scheduler may read this answer after the next one was written
        peer = (context.peer() or "", request.step_id % 2)
        arena = self._arenas.get(peer)
        if arena is None:
            arena = ShmArena()
            self._arenas[peer] = arena
            while len(self._arenas) > MAX_PEER_ARENAS:
                _, old = self._arenas.popitem(last=False)
                old.close()
        self._arenas.move_to_end(peer)
        return TensorCodec("shm", arena=arena, reader=self._reader)

    def _validate(self, step: StepRequest) -> None:
        cap, vocab = self.runner.capacity, self.runner.config.vocab_size
        for pairs, n, pool in ((step.copy_blocks, cap.num_blocks, ""),
                               (step.copy_window_blocks, cap.num_window_blocks, "windowed layers' ")):
            for src, dst in pairs:
                if not (0 <= src < n and 0 <= dst < n) or src == dst:
                    raise BadStep(f"{pool}block copy {src} -> {dst}: block ids must be distinct and lie in "
                                  f"[0, {n})")
        seen = set()
        for c in step.chunks:
            where = f"sequence {c.seq_id}"
            if c.seq_id in seen:
                raise BadStep(f"{where} appears twice in one step")
            seen.add(c.seq_id)
            tokens, table = np.asarray(c.token_ids), np.asarray(c.block_table)
            if tokens.ndim != 1 or tokens.size == 0 or tokens.dtype.kind not in "iu":
                raise BadStep(f"{where}: token_ids must be a non-empty 1-D integer array, "
                              f"got dtype {tokens.dtype} shape {tokens.shape}")
            if table.ndim != 1 or (table.size and table.dtype.kind not in "iu"):
                raise BadStep(f"{where}: block_table must be a 1-D integer array, "
                              f"got dtype {table.dtype} shape {table.shape}")
            placeholder = tokens.size == 1 and int(tokens[0]) == -1     # "the token you sampled last"
            if c.num_draft and int(tokens[-1]) == -1:       # drafted positions this worker fills in
                if self.runner.drafter is None:
                    raise BadStep(f"{where}: asks this worker to draft tokens but it has no draft model "
                                  "(start it with --draft-model)")
                if c.num_draft >= tokens.size or (tokens[-c.num_draft:] != -1).any():
                    raise BadStep(f"{where}: a chunk asking for drafts ends in num_draft placeholders (-1)")
            real = tokens[:-c.num_draft] if c.num_draft and int(tokens[-1]) == -1 else tokens
            if not placeholder and (real.min() < 0 or real.max() >= vocab):
                raise BadStep(f"{where}: token ids must lie in [0, {vocab}), got {int(real.min())}.."
                              f"{int(real.max())}")
            if table.size and (table.min() < 0 or table.max() >= cap.num_blocks):
                raise BadStep(f"{where}: block ids must lie in [0, {cap.num_blocks}), got "
                              f"{int(table.min())}..{int(table.max())}")
            end = c.start_pos + tokens.size
            if cap.num_window_blocks:
                self._validate_window_table(c, where, end)
            if c.start_pos < 0 or end > cap.max_context:
                raise BadStep(f"{where}: positions {c.start_pos}..{end - 1} are outside this worker's "
                              f"context of {cap.max_context} tokens")
            needed = -(-end // cap.block_size) if self.runner.config.causal else 0   # canvases keep no K/V
            if c.diffusion is not None:
                d = c.diffusion
                if self.runner.config.causal:
                    raise BadStep(f"{where}: a diffusion step for an autoregressive model")
                if not c.prompt_len <= d.block_start <= d.block_end <= tokens.size:
                    raise BadStep(f"{where}: diffusion block [{d.block_start}, {d.block_end}) must lie in the "
                                  f"canvas after the prompt [{c.prompt_len}, {tokens.size})")
                try:
                    d.params.validate()
                except ValueError as exc:
                    raise BadStep(f"{where}: {exc}") from None
            if table.size < needed:
                raise BadStep(f"{where}: block table has {table.size} blocks, {needed} needed for "
                              f"{end} tokens (block size {cap.block_size})")
            if not 0 <= c.prompt_len:
                raise BadStep(f"{where}: prompt_len must be >= 0, got {c.prompt_len}")
            if c.score_top_k > vocab:
                raise BadStep(f"{where}: score_top_k {c.score_top_k} exceeds the vocabulary ({vocab})")
            if c.score_targets is not None:
                targets = np.asarray(c.score_targets)
                if targets.shape != tokens.shape or (targets.size and (targets.min() < -1 or targets.max() >= vocab)):
                    raise BadStep(f"{where}: score_targets must hold one token id in [-1, {vocab}) per chunk token")
            if c.params is not None:
                try:    # max_tokens is the scheduler's business (0 for a scoring-only request)
                    dataclasses.replace(c.params, max_tokens=1).validate()
                except ValueError as exc:
                    raise BadStep(f"{where}: {exc}") from None

    def _validate_window_table(self, c, where: str, end: int) -> None:
        """The windowed layers' table of a chunk: as long as its block table, and a block of that pool
        (not -1) wherever the chunk's queries read or write."""
        cap = self.runner.capacity
        if c.window_table is None:
            if self.runner.config.causal:
                raise BadStep(f"{where}: this worker keeps its sliding-window layers in a pool of their own; "
                              "the chunk needs a window_block_table")
            return
        table = np.asarray(c.window_table)
        if table.ndim != 1 or table.size != np.asarray(c.block_table).size or (table.size and table.dtype.kind not in "iu"):
            raise BadStep(f"{where}: window_block_table must be a 1-D integer array as long as block_table")
        first = max(0, c.start_pos - cap.window + 1) // cap.block_size
        live = table[first:-(-end // cap.block_size)]
        if live.size and (live.min() < 0 or live.max() >= cap.num_window_blocks):
            raise BadStep(f"{where}: windowed block ids must lie in [0, {cap.num_window_blocks}) from block "
                          f"{first} on, got {int(live.min())}..{int(live.max())}")
        if table.size and table.max() >= cap.num_window_blocks:
            raise BadStep(f"{where}: windowed block ids must lie below {cap.num_window_blocks}")

    # ------------------------------------------------------------------ RPCs
    def Describe(self, request, context):
        cfg, cap = self.runner.config, self.runner.capacity
        return worker_pb2.DescribeResponse(
            model_name=self.model_name, architecture=cfg.architecture, fingerprint=cfg.fingerprint,
            vocab_size=cfg.vocab_size, num_blocks=cap.num_blocks, block_size=cap.block_size,
            max_context=cap.max_context, n_layers=cfg.n_layers, backend=self.backend,
            hostname=self.hostname, kv_heads=cfg.n_kv_heads, head_dim=cfg.head_dim,
            kv_cache_dtype=block_transfer.pool_dtype_name(self.runner.kv), draft_model=self.draft_model_name,
            diffusion=not cfg.causal, mask_token_id=cfg.mask_token_id, context_length=cfg.context_length,
            num_window_blocks=cap.num_window_blocks, window=cap.window)

    def Step(self, request, context):
        with self._lock:
            # A scheduler pipelines a decode step behind the one running; the RPC threads may pick
            # them up in either order, so a step waits (briefly) for its predecessor. A lower id
            # means a new scheduler numbering from 1 again: it runs at once.
            self._lock.wait_for(lambda: not self._last_step_id < request.step_id - 1 or self._closed,
                                timeout=STEP_ORDER_WAIT_S)
            self._last_step_id = request.step_id
            try:
                return self._step(request, context)
            finally:
                self._lock.notify_all()

    def StepStream(self, request_iterator, context):
        """Steps over one stream, answered in order. Each step is decoded, validated and queued
        on the model thread as soon as it arrives (on a reader thread), so a step pipelined
        behind the running one starts the moment that one ends. A refused or failed step ends
        the stream with the status a Step call would get."""
        queued: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._read_steps, args=(request_iterator, queued), name="step-reader",
                         daemon=True).start()
        while (item := queued.get()) is not None:
            request, running, error, arrived = item
            if error is None:
                try:
                    result = running.result()
                except Exception as exc:            # noqa: BLE001 - mapped to a status below
                    error = exc
            if error is not None:
                self._abort_for(error, request, context)
            yield self._answer(request, result, context, queued_at=arrived)

    def _read_steps(self, requests, queued: queue.SimpleQueue) -> None:
        try:
            for request in requests:
                t0 = time.perf_counter()
                try:
                    if self._closed:
                        raise WorkerClosing()
                    with self._lock:
                        step = self._decode(request)
                except Exception as exc:            # noqa: BLE001 - answered in order, then the stream ends
                    queued.put((request, None, exc, t0))
                    return
                queued.put((request, self._model_thread.submit(self.runner.execute, step), None, t0))
        except grpc.RpcError:                       # the scheduler closed or cancelled the stream
            pass
        finally:
            queued.put(None)

    def _step(self, request, context):
        if self._closed:
            context.abort(grpc.StatusCode.UNAVAILABLE, "worker is shutting down")
        if not context.is_active():      # the scheduler gave up on it (e.g. it found us hung): its
            context.abort(grpc.StatusCode.CANCELLED, "step cancelled by the scheduler")   # blocks are reused
        t0 = time.perf_counter()
        try:
            result = self._model_thread.submit(self.runner.execute, self._decode(request)).result()
        except Exception as exc:                    # noqa: BLE001 - mapped to a status
            self._abort_for(exc, request, context)
        return self._answer(request, result, context, queued_at=t0)

    def _decode(self, request) -> StepRequest:
        step = step_request_from_proto(request, self._decoder)
        self._validate(step)
        return step

    def _answer(self, request, result, context, queued_at: float) -> worker_pb2.StepResponse:
        if log.isEnabledFor(logging.DEBUG):
            log.debug("step %d: %d tokens, %.1f ms from arrival to result, arrived %.1f ms after the "
                      "previous answer (negative: queued behind the running step)", request.step_id,
                      result.tokens_computed, (time.perf_counter() - queued_at) * 1e3,
                      (queued_at - self._last_step_end) * 1e3)
        self.steps += 1
        with self._lock:
            response = step_result_to_proto(result, self._response_codec(request, context), step_id=request.step_id)
        self._last_step_end = time.perf_counter()
        return response

    @staticmethod
    def _abort_for(exc: Exception, request, context) -> None:
        if isinstance(exc, WorkerClosing):
            context.abort(grpc.StatusCode.UNAVAILABLE, "worker is shutting down")
        if isinstance(exc, (BadStep, ValueError, TypeError, FileNotFoundError, IndexError)):
            log.warning("step %d refused: %s", request.step_id, exc)
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        log.error("step %d failed", request.step_id, exc_info=exc)      # a bug, not the caller's input
        context.abort(grpc.StatusCode.INTERNAL, f"worker step failed: {type(exc).__name__}: {exc}")

    def ExportBlocks(self, request, context):
        """The K/V of the listed blocks, every layer; through shared memory to a peer on this host."""
        try:
            kv = self._model_thread.submit(block_transfer.export_blocks, self.runner.kv,
                                           list(request.blocks.block_ids),
                                           list(request.window_blocks.block_ids)).result()
        except block_transfer.BlockTransferError as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"ExportBlocks: {exc}")
        with self._transfer_lock:       # one export at a time writes the arena (valid until the next one)
            codec = self._transfer_codec(context)
            codec.begin_message()
            return worker_pb2.ExportBlocksResponse(kv=codec.encode(kv))

    def ImportBlocks(self, request, context):
        """Writes exported K/V into the listed blocks, between steps; nothing on a mismatch."""
        try:
            # a view of the sender's shared memory (it waits for this reply before reusing it):
            # the pool is its only copy
            kv = self._viewer.decode(request.kv)
            self._model_thread.submit(block_transfer.import_blocks, self.runner.kv, list(request.blocks.block_ids),
                                      kv, list(request.window_block_ids)).result()
        except (block_transfer.BlockTransferError, ValueError, OSError) as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"ImportBlocks: {exc}")
        return worker_pb2.ImportBlocksResponse()

    def _transfer_codec(self, context) -> TensorCodec:
        wanted = self._asked_transport(context) or (self.transport if self.transport != "auto" else None)
        if wanted is None:
            wanted = "shm" if is_local_address(peer_host(context.peer() or "")) else "inline"
        if wanted == "inline":
            return self._inline
        with self._lock:        # one arena per peer for block transfers, apart from the steps' two
            key = (context.peer() or "", "blocks")
            arena = self._arenas.get(key)
            if arena is None:
                arena = self._arenas[key] = ShmArena()
        return TensorCodec("shm", arena=arena, reader=self._reader)

    def close(self) -> None:
        """Refuses further steps, reports NOT_SERVING, and unlinks this worker's shared-memory segments."""
        if self.health is not None:
            self.health.shutdown()
        with self._lock:
            self._closed = True
            self._lock.notify_all()
            for arena in self._arenas.values():
                arena.close()
            self._arenas.clear()
            self._reader.close()
        self._model_thread.shutdown(wait=False)


def start_server(servicer: WorkerServicer, host: str, port: int, max_workers: int = 8,
                 internal_token: str | None = None) -> tuple[grpc.Server, int]:
    """Starts a sync gRPC server; returns it and the bound port (port 0 picks a free one)."""
    options = [("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
               ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
               ("grpc.so_reuseport", 0)]
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="worker-rpc"),
                         interceptors=[DecodeErrorInterceptor(),
                                       *([internal_interceptor(internal_token, asynchronous=False)]
                                         if internal_token else [])], options=options)
    worker_pb2_grpc.add_WorkerServicer_to_server(servicer, server)
    # the model is loaded before the server starts: SERVING from the first answer until close()
    servicer.health = HealthReporter(server, [WORKER_SERVICE], serving=True)
    target = f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"
    bound = server.add_insecure_port(target)
    if bound == 0:
        raise OSError(f"cannot listen on {target} (address in use or not available)")
    server.start()
    return server, bound
