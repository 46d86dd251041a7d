"""What the scheduler's gRPC handlers and its engine loop pass between them: one Submit stream
(`Handle`: the request's queue of SubmitEvents on the handler's asyncio loop), the refusal of a
Submit before it starts, and the delivery of a step's events to their loops."""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

import grpc

from protos.tensorserve.v1 import common_pb2


class SubmitRefused(Exception):
    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code, self.message = code, message


@dataclass
class Handle:
    """One Submit stream as the engine loop sees it."""
    request_id: str
    seq: Any                     # a scheduler.sequence.Sequence, or a served diffusion request
    queue: asyncio.Queue
    loop: asyncio.AbstractEventLoop
    prompt_logprobs: int | None = None
    emitted: int = 0
    prompt_sent: bool = False
    done: bool = False
    submitted_at: float = field(default_factory=time.monotonic)


def serving_status(ok: bool) -> int:
    return common_pb2.SERVING_STATUS_SERVING if ok else common_pb2.SERVING_STATUS_NOT_SERVING


def deliver(events: list) -> None:
    """(handle, event) pairs onto their handlers' queues, one call_soon_threadsafe per loop."""
    by_loop: dict = {}
    for h, ev in events:
        by_loop.setdefault(h.loop, []).append((h.queue, ev))
    for loop, items in by_loop.items():
        try:
            loop.call_soon_threadsafe(_put_all, items)
        except RuntimeError:        # the loop is closed: the process is exiting
            pass


def _put_all(items) -> None:
    for q, ev in items:
        q.put_nowait(ev)
