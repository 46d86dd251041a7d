"""One model's scheduler replicas as the router sees them: a gRPC client each, the requests the
router has in flight there, and what its prefix cache holds (watched through WatchPrefixCache).

A replica whose watch stream is down (its scheduler died or restarts) or whose scheduler says it
does not serve (its worker is down) is skipped while another serves. When the stream comes back,
the first update is a reset: a restarted scheduler's cache is empty, and so is the router's view."""
from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Sequence

import grpc

from protos.tensorserve.v1 import scheduler_pb2
from router.prefix_routing import PrefixView, policy
from router.scheduler_client import SchedulerClient

log = logging.getLogger("tensorserve.router")

WATCH_RETRY_S = 0.5
UNIMPLEMENTED_RETRY_S = 30.0
WATCH_INTERVAL_MS = 50


class Replica:
    def __init__(self, model: str, index: int, address: str, internal_token: str | None):
        self.model, self.index, self.address = model, index, address
        self.client = SchedulerClient(address, internal_token)
        self.view = PrefixView()
        self.in_flight = 0          # requests this router has sent here and not seen finish
        self.connected = False      # the watch stream is open
        self.serving = False        # the scheduler's last word: it and its worker take requests

    @property
    def available(self) -> bool:
        return self.connected and self.serving

    async def watch(self) -> None:
        """Follow the scheduler's prefix cache for as long as the router runs, reconnecting after
        the stream breaks."""
        request = scheduler_pb2.WatchPrefixCacheRequest(interval_ms=WATCH_INTERVAL_MS)
        while True:
            try:
                async for update in self.client.stub.WatchPrefixCache(request, metadata=self.client.metadata):
                    if update.reset or (update.block_size, update.fingerprint.encode()) != (
                            self.view.block_size, self.view.salt):
                        self.view.reset(update.block_size, update.fingerprint)
                    self.view.apply(update.added, update.removed)
                    if not self.connected:
                        log.info("scheduler %s (%s #%d) connected: %d cached blocks", self.address, self.model,
                                 self.index, len(self.view.held))
                    self.connected, self.serving = True, update.serving
            except grpc.RpcError as exc:
                if exc.code() == grpc.StatusCode.UNIMPLEMENTED:   # an older scheduler: no cache to follow
                    self.connected = self.serving = False
                    await asyncio.sleep(UNIMPLEMENTED_RETRY_S)
                    continue
                if self.connected:
                    log.warning("scheduler %s (%s #%d) is gone (%s); its requests go to the other replicas",
                                self.address, self.model, self.index, exc.code().name)
            self.connected = self.serving = False
            self.view.reset()
            await asyncio.sleep(WATCH_RETRY_S)


class ReplicaSet:
    """A model's replicas and the policy (--routing) that picks one for a request."""

    def __init__(self, model: str, addresses: Sequence[str], internal_token: str | None = None,
                 routing: str = "prefix-aware"):
        self.replicas = [Replica(model, i, a, internal_token) for i, a in enumerate(addresses)]
        self.policy = policy(routing)
        self._watchers: list[asyncio.Task] = []

    def __len__(self) -> int:
        return len(self.replicas)

    def start(self) -> None:
        """Start watching (inside the running loop; idempotent)."""
        if not self._watchers:
            self._watchers = [asyncio.get_running_loop().create_task(r.watch()) for r in self.replicas]

    def choose(self, prompt_ids: Sequence[int], tried: set[int] = frozenset()) -> tuple[Replica, int]:
        """The replica for a prompt, and how many of its blocks that replica is known to hold. Serving
        replicas not yet tried for this request first; if none, any not tried; then any."""
        self.start()
        fresh = [r for r in self.replicas if r.index not in tried]
        pool = [r for r in fresh if r.available] or fresh or self.replicas
        replica, chain = self.policy.choose(pool, prompt_ids)
        hit = replica.view.longest_prefix(chain) if chain else 0
        replica.view.expect(chain)
        return replica, hit

    async def close(self) -> None:
        for task in self._watchers:
            task.cancel()
        for task in self._watchers:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for r in self.replicas:
            await r.client.close()
