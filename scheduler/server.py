"""The scheduler's gRPC service (protos/tensorserve/v1/scheduler.proto): request validation and
the handlers, around the engine loop of scheduler/core.py."""
from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import random
import time
import uuid

import grpc

from protos.tensorserve.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc
from shared.grpc_auth import internal_interceptor
from shared.grpc_errors import AsyncDecodeErrorInterceptor
from shared.grpc_health import AsyncHealthReporter

SCHEDULER_SERVICE = scheduler_pb2.DESCRIPTOR.services_by_name["Scheduler"].full_name
from scheduler.core import SchedulerCore
from scheduler.diffusion.serving import diffusion_request
from scheduler.handles import Handle, SubmitRefused
from scheduler.sequence import Sequence
from shared.step_codec import sampling_params_from_proto

log = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 256 * 2**20
DEFAULT_WATCH_INTERVAL_MS = 50
# Sequence ids name worker-side state (penalty history, RNG): start at a random offset so that two
# schedulers, or a restarted one, never reuse an id a worker may still remember.
_seq_ids = itertools.count(random.getrandbits(40) << 16)

__all__ = ["SchedulerCore", "SchedulerServicer", "build_server"]


class SchedulerServicer(scheduler_pb2_grpc.SchedulerServicer):
    def __init__(self, core: SchedulerCore):
        self.core = core

    def _validate(self, request: scheduler_pb2.SubmitRequest) -> Sequence:
        core = self.core
        d = core.description
        if core.draining:
            raise SubmitRefused(grpc.StatusCode.UNAVAILABLE,
                                "the scheduler is shutting down and accepts no new requests")
        if core.engine is None or d is None:
            raise SubmitRefused(grpc.StatusCode.UNAVAILABLE, f"no worker is serving: {core.health_message}")
        if request.model and d.model_name and not _same_model(request.model, d):
            raise SubmitRefused(grpc.StatusCode.NOT_FOUND,
                                f"model {request.model!r} is not served here (this scheduler serves {d.model_name!r})")
        prompt = [int(t) for t in request.prompt_token_ids]
        if not prompt:
            raise SubmitRefused(grpc.StatusCode.INVALID_ARGUMENT, "the prompt is empty: send at least one token")
        vocab = int(d.vocab_size)
        if vocab:
            bad = [t for t in prompt if t < 0 or t >= vocab]
            if bad:
                raise SubmitRefused(grpc.StatusCode.INVALID_ARGUMENT,
                                    f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab})")
        params = sampling_params_from_proto(request.sampling)
        score_only = request.HasField("prompt_logprobs") and request.sampling.HasField("max_tokens") \
            and request.sampling.max_tokens == 0
        try:
            (dataclasses.replace(params, max_tokens=1) if score_only else params).validate()
        except (ValueError, TypeError) as exc:
            raise SubmitRefused(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None
        eos_ids = frozenset(int(t) for t in request.eos_token_ids)
        if vocab:
            for what, ids in (("stop token id", params.stop_token_ids), ("end-of-generation token id", eos_ids)):
                bad = [t for t in ids if t < 0 or t >= vocab]
                if bad:
                    raise SubmitRefused(grpc.StatusCode.INVALID_ARGUMENT,
                                        f"{what} {bad[0]} is outside the vocabulary [0, {vocab})")
        limit = int(d.max_context)
        if len(prompt) + (0 if score_only else 1) > limit:
            raise SubmitRefused(grpc.StatusCode.INVALID_ARGUMENT,
                                f"prompt has {len(prompt)} tokens but the context holds {limit}"
                                + ("" if score_only else " (and at least one must be generated)"))
        if d.diffusion:
            return diffusion_request(request, params, d, next(_seq_ids))
        if request.HasField("diffusion"):
            raise SubmitRefused(grpc.StatusCode.INVALID_ARGUMENT,
                                f"diffusion options were sent, but {d.model_name!r} is an autoregressive model: "
                                "leave them out")
        seq = Sequence(prompt, params, seq_id=next(_seq_ids), eos_ids=eos_ids)
        if request.HasField("speculative"):
            seq.speculative = request.speculative
        if request.HasField("prompt_logprobs"):
            k = max(int(request.prompt_logprobs), 1)     # each prompt token's own logprob comes besides
            seq.score_top_k = min(k, vocab) if vocab else k
            seq.generate_after_score = not score_only
        return seq

    async def Submit(self, request, context):
        t0 = time.perf_counter()
        try:
            seq = self._validate(request)
            handle = Handle(request.request_id or uuid.uuid4().hex, seq, asyncio.Queue(),
                             asyncio.get_running_loop(),
                             prompt_logprobs=int(request.prompt_logprobs)
                             if request.HasField("prompt_logprobs") else None)
            self.core.submit(handle)
        except SubmitRefused as exc:
            await context.abort(exc.code, exc.message)
            return
        finished = False
        try:
            while True:
                ev = await handle.queue.get()
                if t0 and log.isEnabledFor(logging.DEBUG):
                    log.debug("request %s: first event %.1f ms after Submit", handle.request_id,
                              (time.perf_counter() - t0) * 1e3)
                    t0 = 0.0
                if ev.finish_reason:
                    finished = True
                yield ev
                if finished:
                    return
        finally:
            if not finished:          # cancelled by the client, or the stream broke
                self.core.abort(handle.request_id, notify_client=False)

    async def Abort(self, request, context):
        return scheduler_pb2.AbortResponse(found=self.core.abort(request.request_id))

    async def Stats(self, request, context):
        stats = self.core.stats()
        ok, message, components = self.core.health()
        stats.status = common_pb2.SERVING_STATUS_SERVING if ok else common_pb2.SERVING_STATUS_NOT_SERVING
        stats.status_message = message
        stats.components.extend(components)
        return stats

    async def WatchPrefixCache(self, request, context):
        interval = (request.interval_ms or DEFAULT_WATCH_INTERVAL_MS) / 1000
        core, journal = self.core, self.core.prefix_journal
        sent: set[bytes] = set()
        seen_version, last = -1, None
        while not core.draining:      # a stopping scheduler ends the stream (the router sees it gone)
            serving, in_flight = core.engine is not None and not core.draining, core.in_flight()
            if journal.version != seen_version or (serving, in_flight) != last:
                seen_version = journal.version
                added, removed = journal.changes_since(sent)
                yield scheduler_pb2.PrefixCacheUpdate(
                    reset=last is None, added=added, removed=removed, block_size=journal.block_size,
                    fingerprint=journal.fingerprint, serving=serving, in_flight=in_flight)
                last = (serving, in_flight)
            await asyncio.sleep(interval)

    async def RegisterWorker(self, request, context):
        if not request.address:
            return scheduler_pb2.RegisterWorkerResponse(accepted=False, message="address is empty: send host:port")
        ok, message = self.core.register_worker(request.address)
        return scheduler_pb2.RegisterWorkerResponse(accepted=ok, message=message)


def _same_model(name: str, d) -> bool:
    def norm(s: str) -> str:
        s = s.strip().lower()
        for suffix in (".gguf",):
            s = s.removesuffix(suffix)
        return s.rsplit("/", 1)[-1]
    wanted = norm(name)
    return wanted in {norm(d.model_name), norm(d.fingerprint)} or norm(d.model_name).startswith(wanted)


def build_server(core: SchedulerCore, host: str, port: int) -> tuple[grpc.aio.Server, int]:
    token = core.config.internal_token
    interceptors = [AsyncDecodeErrorInterceptor(), *([internal_interceptor(token, asynchronous=True)] if token else [])]
    server = grpc.aio.server(interceptors=interceptors, options=[
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ("grpc.so_reuseport", 0),
    ])
    scheduler_pb2_grpc.add_SchedulerServicer_to_server(SchedulerServicer(core), server)
    core.health_reporter = AsyncHealthReporter(server, [SCHEDULER_SERVICE])
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"cannot listen on {host}:{port}")
    return server, bound
