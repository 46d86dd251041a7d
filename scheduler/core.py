"""The scheduler's engine loop and the state its gRPC handlers share with it.

Threads. The engine (scheduler/engine.py) is synchronous and single-threaded:
one thread, the *engine loop*, owns it — it adds and aborts sequences, calls
``Engine.step`` (which sends Step calls to the worker and waits for one result;
during steady decoding the next step is already sent, see Engine.step) and
turns the progress into ``SubmitEvent``s. The gRPC handlers run on an asyncio
loop (grpc.aio); they never touch the engine. They hand work to the engine
loop through an inbox (a deque under a condition variable, which also wakes
the loop when it is idle), and receive events through one ``asyncio.Queue``
per request, filled with ``loop.call_soon_threadsafe`` once per step.

Worker lifecycle. The loop dials the worker (``--worker`` or the address a
worker gave in RegisterWorker), retries Describe with backoff until it answers,
then builds an Engine sized by the worker's num_blocks/block_size/max_context.
When a Step fails, every in-flight request ends with FINISH_REASON_ERROR and
an ErrorDetail (code "worker_unavailable"), the engine is dropped (its blocks
and sequences with it), Health turns NOT_SERVING with the reason, new Submits
get UNAVAILABLE, and the loop goes back to dialing: a worker that comes back
(the same address, or a new one registering) gets a fresh Describe and a new
engine.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from typing import Callable

import grpc

from protos.tensorserve.v1 import common_pb2, scheduler_pb2
from scheduler.checkpoint_tier import CheckpointTier, checkpoint_stats, open_tier
from scheduler.config import SchedulerConfig
from scheduler.diffusion.serving import DiffusionEngine, diffusion_progress_event, diffusion_stats
from scheduler.engine import Engine
from scheduler.handles import Handle, SubmitRefused, deliver, serving_status
from scheduler.events import final_event, progress_event
from scheduler.prefix_journal import PrefixJournal
from scheduler.stats import engine_stats
from scheduler.sequence import Sequence
from scheduler.speculative import SpeculativeController, SpeculativeStats, make_controller
from scheduler.worker_client import WorkerClient, WorkerFailure
from shared.step import StepRequest, StepResult

log = logging.getLogger(__name__)


class SchedulerCore:
    """The engine loop thread and everything the gRPC handlers share with it."""

    def __init__(self, config: SchedulerConfig, retry_initial_s: float = 0.2, retry_max_s: float = 2.0):
        self.config = config
        worker_address = config.worker
        self.worker_address = worker_address
        self.transport = config.tensor_transport
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.max_prefill_tokens_while_decoding = config.max_prefill_tokens_while_decoding
        self.num_decode_steps = config.num_decode_steps
        self.enable_prefix_caching = config.enable_prefix_caching
        self.retry_initial_s, self.retry_max_s = retry_initial_s, retry_max_s
        self._cond = threading.Condition()
        self._inbox: deque[tuple] = deque()
        self._handles: dict[str, Handle] = {}          # in flight, by request id (under _cond)
        self._by_seq: dict[int, Handle] = {}           # engine-loop only
        self.engine: Engine | None = None
        self._stores: dict[str, list] = {}              # the checkpoint stores, by model fingerprint
        self._tier: CheckpointTier | None = None        # the current engine's
        self.client: WorkerClient | None = None
        self.description = None
        self.health_message = ("waiting for a worker to register (no --worker given)" if not worker_address
                               else f"connecting to worker {worker_address}")
        self.worker_message = self.health_message
        self.draining = False
        self.health_reporter = None          # the grpc.health.v1 service, set by build_server
        self._stop = False
        self.tokens_computed = 0
        self.steps = 0
        self._snapshot = scheduler_pb2.StatsResponse()
        self.prefix_journal = PrefixJournal()           # the prefix cache's hashes, for WatchPrefixCache
        # the engine's kind decides these: an autoregressive Engine's, or a text-diffusion model's
        self._stats_of, self._progress_of = engine_stats, progress_event
        self._speculative_stats = SpeculativeStats()    # since start, across engines (worker restarts)
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        self._thread.join(timeout)
        if self.client is not None:
            self.client.close()
        if self._tier is not None:
            self._tier.close()
        for stores in self._stores.values():
            for store in stores:
                store.close()

    @property
    def ready(self) -> bool:
        return self.engine is not None

    def in_flight(self) -> int:
        with self._cond:
            return len(self._handles)

    # ------------------------------------------------------------------ called by handlers
    def submit(self, handle: Handle) -> None:
        with self._cond:
            if self.draining:
                raise SubmitRefused(grpc.StatusCode.UNAVAILABLE,
                                    "the scheduler is shutting down and accepts no new requests")
            if self.engine is None:
                raise SubmitRefused(grpc.StatusCode.UNAVAILABLE, f"no worker is serving: {self.health_message}")
            if handle.request_id in self._handles:
                raise SubmitRefused(grpc.StatusCode.ALREADY_EXISTS,
                                    f"request_id {handle.request_id!r} is already in flight")
            self._handles[handle.request_id] = handle
            self._inbox.append(("add", handle))
            self._cond.notify_all()

    def abort(self, request_id: str, notify_client: bool = True) -> bool:
        with self._cond:
            if request_id not in self._handles:
                return False
            self._inbox.append(("abort", request_id, notify_client))
            self._cond.notify_all()
            return True

    def abort_all(self, message: str) -> None:
        with self._cond:
            for rid in list(self._handles):
                self._inbox.append(("error", rid, "shutting_down", message))
            self._cond.notify_all()

    def register_worker(self, address: str) -> tuple[bool, str]:
        with self._cond:
            if self.engine is not None and self.worker_address and address != self.worker_address:
                return False, (f"this scheduler already serves worker {self.worker_address}; "
                               f"one worker per scheduler (start another scheduler for {address})")
            changed = address != self.worker_address
            self.worker_address = address
            if changed or self.engine is None:
                self.health_message = f"connecting to worker {address}"
            self._cond.notify_all()
        log.info("worker registered at %s", address)
        return True, ""

    def health(self) -> tuple[bool, str, list[common_pb2.ComponentHealth]]:
        """(serving, why not, the scheduler and its worker as components)."""
        ok = self.ready and not self.draining
        if self.draining:
            message = "the scheduler is shutting down"
        elif not self.ready:
            message = self.health_message or "no worker"
        else:
            message = ""
        d = self.description
        worker_message = ("" if self.ready else (self.worker_message or self.health_message)) \
            or (f"{d.model_name} at {self.worker_address}" if d else "")
        return ok, message, [
            common_pb2.ComponentHealth(name="scheduler", message=message, status=serving_status(ok)),
            common_pb2.ComponentHealth(name="worker-0", message=worker_message, status=serving_status(self.ready))]

    async def report_health(self, period_s: float = 0.5) -> None:
        """Keeps the standard health service's status in step with `health()` until draining."""
        reporter = self.health_reporter
        while reporter is not None and not self.draining:
            await reporter.set(self.health()[0])
            await asyncio.sleep(period_s)
        if reporter is not None:
            await reporter.shutdown()

    def stats(self) -> scheduler_pb2.StatsResponse:
        with self._cond:
            s = scheduler_pb2.StatsResponse()
            s.CopyFrom(self._snapshot)
            s.tokens_computed, s.steps = self.tokens_computed, self.steps
            engine = self.engine
            if engine is not None and engine.checkpoints is not None:   # the writer goes on while the engine idles
                s.checkpoints.CopyFrom(checkpoint_stats(engine))
            return s

    # ------------------------------------------------------------------ engine loop
    def _run(self) -> None:
        delay = self.retry_initial_s
        while True:
            with self._cond:
                if self._stop:
                    return
            if self.engine is None:
                if self._connect():
                    delay = self.retry_initial_s
                else:
                    with self._cond:
                        if not self._stop:
                            self._cond.wait(delay)
                    delay = min(delay * 2, self.retry_max_s)
                continue
            with self._cond:
                while not self._stop and not self._inbox and not self.engine.has_work():
                    self._cond.wait()
                if self._stop:
                    return
                t_drained = time.perf_counter()
                events = self._drain_inbox()
                self._update_snapshot()
                has_work = self.engine.has_work()
            deliver(events)
            if not has_work:
                continue
            try:
                t_step = time.perf_counter()
                progressed = self.engine.step()
                if log.isEnabledFor(logging.DEBUG):
                    log.debug("engine step %d: %.1f ms (%.1f ms since the inbox was drained)", self.steps,
                              (time.perf_counter() - t_step) * 1e3, (time.perf_counter() - t_drained) * 1e3)
            except WorkerFailure as exc:
                self._on_worker_failure(exc)
                continue
            except Exception as exc:   # engine bug or KV exhausted: fail what is in flight, keep serving
                log.exception("engine step failed")
                self._reset_engine("internal", f"the scheduler's engine failed: {exc}")
                continue
            events = [ev for seq in progressed if (ev := self._event_for(seq)) is not None]
            with self._cond:
                for handle, ev in events:
                    if handle.done:
                        self._handles.pop(handle.request_id, None)
                self._update_snapshot()
            deliver(events)

    def _execute(self, request: StepRequest) -> StepResult:
        return self._submit(request)()

    def _submit(self, request: StepRequest) -> Callable[[], StepResult]:
        wait = self.client.submit(request)

        def counted() -> StepResult:
            result = wait()
            self.tokens_computed += int(result.tokens_computed)
            self.steps += 1
            return result
        return counted

    def _connect(self) -> bool:
        with self._cond:
            address = self.worker_address
        if not address:
            return False
        client = WorkerClient(address, self.transport, probe_after_s=self.config.worker_probe_after,
                              internal_token=self.config.internal_token)
        try:
            d = client.describe(timeout_s=2.0)
            if self.config.speculative == "draft" and not d.draft_model:
                raise WorkerFailure(f"worker {address} runs no draft model, which --speculative draft needs: "
                                    "start the worker with --draft-model")
        except WorkerFailure as exc:
            client.close()
            now = time.monotonic()
            if now - getattr(self, "_last_wait_log", 0.0) > 5.0:
                log.warning("waiting for worker at %s: %s (retrying)", address, exc)
                self._last_wait_log = now
            with self._cond:
                self.worker_message = str(exc)
                if self.engine is None and not self.health_message.startswith("worker "):
                    self.health_message = f"waiting for worker at {address}: {exc}"
            return False
        except Exception as exc:    # bad address and the like: keep trying, but say why
            client.close()
            log.warning("cannot dial worker at %s: %s", address, exc)
            return False
        engine = self._new_engine(d, client)
        with self._cond:
            if self.client is not None:
                self.client.close()
            self.client, self.description, self.engine = client, d, engine
            self.health_message = ""
            self.worker_message = ""
            self._update_snapshot()
        log.info("worker %s at %s: model %s (%s), %d KV blocks of %d tokens, context %d, vocab %d, "
                 "tensors %s", d.model_name, address, d.architecture, d.backend, d.num_blocks, d.block_size,
                 d.max_context, d.vocab_size, client.transport)
        return True

    def _new_engine(self, d, client: WorkerClient) -> Engine | DiffusionEngine:
        if self._tier is not None:
            self._tier.close()
            self._tier = None
        if d.diffusion:     # non-causal passes over whole canvases: no KV blocks, no prefix cache
            self._stats_of, self._progress_of = diffusion_stats, diffusion_progress_event
            self.prefix_journal.clear(0, d.fingerprint)
            return DiffusionEngine(self._execute, d.max_context, self.max_num_seqs, self.max_num_batched_tokens)
        self._stats_of, self._progress_of = engine_stats, progress_event
        tier = self._tier = open_tier(self.config, d, client, self._stores) if self.enable_prefix_caching else None
        engine = Engine(self._execute, d.num_blocks, d.block_size, d.max_context,
                      max_num_batched_tokens=self.max_num_batched_tokens, max_num_seqs=self.max_num_seqs,
                      fingerprint=d.fingerprint, enable_prefix_caching=self.enable_prefix_caching,
                      submit=self._submit, max_prefill_tokens_while_decoding=self.max_prefill_tokens_while_decoding,
                      num_decode_steps=self.num_decode_steps, checkpoints=tier,
                      speculative=self._speculative(), num_window_blocks=d.num_window_blocks, window=d.window)
        # a new engine starts with an empty prefix cache: the router's view of us starts again
        self.prefix_journal.clear(d.block_size if self.enable_prefix_caching else 0, d.fingerprint)
        engine.blocks.journal = self.prefix_journal
        return engine

    def _speculative(self) -> SpeculativeController | None:
        """A new engine's controller; its counters go on from the last engine's (they are since start)."""
        c = self.config
        controller = make_controller(c.speculative, c.num_speculative_tokens, c.prompt_lookup_min,
                                     c.prompt_lookup_max, c.speculative_governor)
        if controller is not None:
            controller.stats = self._speculative_stats
        return controller

    def _on_worker_failure(self, exc: WorkerFailure) -> None:
        message = str(exc)
        log.error("%s; failing %d in-flight request(s) and re-dialing", message, len(self._by_seq))
        self._fail_everything("worker_unavailable", message, drop_engine=True)
        try:    # a worker killed with SIGKILL leaves its segments behind: remove those of dead processes
            from shared.shm import sweep_stale_segments
            sweep_stale_segments()
        except OSError:
            pass

    def _reset_engine(self, code: str, message: str) -> None:
        old = self.engine
        self._fail_everything(code, message, drop_engine=False)
        engine = self._new_engine(self.description, self.client)
        # the worker may drop what it remembers of the old engine's sequences
        engine._finished_ids = [s.seq_id for s in [*old.waiting, *old.preempted, *old.running]] + old._finished_ids
        with self._cond:
            self.engine = engine
            self._update_snapshot()

    def _fail_everything(self, code: str, message: str, drop_engine: bool) -> None:
        with self._cond:
            handles = list(self._handles.values())
            self._handles.clear()
            self._inbox.clear()
            self._by_seq.clear()
            if drop_engine:
                self.engine = None
                self.prefix_journal.clear()
                self.health_message = message
                self.worker_message = message
                if self.client is not None:
                    self.client.close()
                    self.client = None
            self._update_snapshot()
        events = []
        for h in handles:
            h.done = True
            events.append((h, final_event(h.seq, "error", code, message)))
        deliver(events)

    def _drain_inbox(self) -> list:
        """Apply queued adds and aborts (under _cond). Returns events to deliver."""
        events = []
        while self._inbox:
            item = self._inbox.popleft()
            if item[0] == "add":
                h = item[1]
                try:
                    self.engine.add(h.seq)
                except ValueError as exc:          # validated by the handler already; defensive
                    h.done = True
                    self._handles.pop(h.request_id, None)
                    events.append((h, final_event(h.seq, "error", "invalid_argument", str(exc))))
                    continue
                self._by_seq[h.seq.seq_id] = h
            else:
                _, rid, *rest = item
                h = self._handles.pop(rid, None)
                if h is None or h.done:
                    continue
                self._by_seq.pop(h.seq.seq_id, None)
                self.engine.abort(h.seq.seq_id)
                h.done = True
                if item[0] == "abort":
                    if rest[0]:
                        events.append((h, final_event(h.seq, "abort")))
                else:
                    events.append((h, final_event(h.seq, "error", rest[0], rest[1])))
        return events

    def _update_snapshot(self) -> None:
        self._snapshot = self._stats_of(self.engine)

    # ------------------------------------------------------------------ events
    def _event_for(self, seq: Sequence):
        h = self._by_seq.get(seq.seq_id)
        if h is None:
            return None
        ev = self._progress_of(seq, h)
        if h.done:
            self._by_seq.pop(seq.seq_id, None)
        return None if ev is None else (h, ev)
