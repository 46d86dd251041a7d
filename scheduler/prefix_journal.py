"""The prefix cache's hashes as the router sees them (the WatchPrefixCache RPC).

The block manager, on the engine thread, tells the journal each hash it registers or forgets;
each watcher (a gRPC stream on the asyncio loop) keeps the set it has sent and, when the
journal's version moved, sends the difference. The sets are compared under the journal's lock,
so the two threads never share a dict the engine is changing; an idle cache costs a watcher one
integer comparison per interval."""
from __future__ import annotations

import threading


class PrefixJournal:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: set[bytes] = set()
        self.version = 0
        self.block_size = 0
        self.fingerprint = ""

    # ---- the engine thread (scheduler/block_manager.py)
    def added(self, digest: bytes) -> None:
        with self._lock:
            self._held.add(digest)
            self.version += 1

    def removed(self, digest: bytes) -> None:
        with self._lock:
            self._held.discard(digest)
            self.version += 1

    def clear(self, block_size: int = 0, fingerprint: str = "") -> None:
        """A new engine (its cache empty) or none: what the watchers hold of us goes."""
        with self._lock:
            self._held.clear()
            self.block_size, self.fingerprint = block_size, fingerprint
            self.version += 1

    # ---- the watchers
    def changes_since(self, sent: set[bytes]) -> tuple[list[bytes], list[bytes]]:
        """(added, removed) relative to `sent`, which becomes the journal's set."""
        with self._lock:
            added = list(self._held - sent)
            removed = list(sent - self._held)
        sent.difference_update(removed)
        sent.update(added)
        return added, removed
