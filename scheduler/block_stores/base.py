"""The block store interface: values (scheduler/block_format.py) under a block's hash, within one
model's namespace. A store never raises to its caller: a store that is down, full or unwritable
answers a miss or a failed put, logs the cause once until it recovers, and counts it."""
from __future__ import annotations

import logging
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass


@dataclass
class StoreStats:
    hits: int = 0
    misses: int = 0
    puts: int = 0
    put_failures: int = 0
    errors: int = 0            # operations that failed because the store was unreachable or broken
    evictions: int = 0


class BlockStore(ABC):
    name = "store"

    def __init__(self, namespace: str):
        self.namespace = namespace            # Geometry.namespace: blocks of other models are never seen
        self.stats = StoreStats()
        self._log = logging.getLogger(f"scheduler.block_stores.{self.name}")
        self._failing: str | None = None      # the cause being reported, until an operation succeeds again

    @abstractmethod
    def get(self, block_hash: bytes) -> bytes | None:
        """The stored value, or None (absent, or the store is unavailable)."""

    @abstractmethod
    def put(self, block_hash: bytes, value: bytes) -> bool:
        """Stores the value whole (never half of it); False when it could not."""

    @abstractmethod
    def contains(self, block_hash: bytes) -> bool:
        ...

    @abstractmethod
    def discard(self, block_hash: bytes) -> None:
        """Removes a value that did not check out (it is rewritten from the pool later)."""

    def get_prefix(self, block_hashes: list[bytes]) -> list[bytes]:
        """The values of the longest leading run of `block_hashes` this store holds (a prefix's
        blocks are wanted in order, and only up to the first one missing)."""
        values = []
        for digest in block_hashes:
            value = self.get(digest)
            if value is None:
                break
            values.append(value)
        return values

    def close(self) -> None:
        pass

    @property
    def available(self) -> bool:
        """False while the store's last operation failed."""
        return self._failing is None

    # ------------------------------------------------------------------ for implementations
    def _failed(self, what: str, exc: BaseException) -> None:
        self.stats.errors += 1
        cause = f"{type(exc).__name__}: {exc}"
        if self._failing != cause:
            self._log.warning("%s store %s failed (%s); serving goes on without it, and it is retried",
                              self.name, what, cause)
            self._failing = cause

    def _succeeded(self) -> None:
        if self._failing is not None:
            self._log.warning("%s store works again", self.name)
            self._failing = None


class Backoff:
    """Skips a broken backend for a while after a failure, so requests never wait on it."""

    def __init__(self, pause_s: float = 2.0):
        self.pause_s = pause_s
        self._until = 0.0

    def open(self) -> bool:
        return time.monotonic() >= self._until

    def trip(self) -> None:
        self._until = time.monotonic() + self.pause_s

    def reset(self) -> None:
        self._until = 0.0
