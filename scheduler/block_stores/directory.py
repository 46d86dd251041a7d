"""The local-directory store (the SSD tier): one file a block under
`<dir>/<fingerprint>/<hash>.tskv`, written to a temporary name and renamed into place (a reader
sees a whole value or none), least recently used files removed past the byte cap."""
from __future__ import annotations

import os
import tempfile
import threading
from collections import OrderedDict
from pathlib import Path

from scheduler.block_stores.base import BlockStore

SUFFIX = ".tskv"


class DirectoryStore(BlockStore):
    name = "directory"

    def __init__(self, namespace: str, root: str | Path, max_bytes: int):
        super().__init__(namespace)
        self.folder = Path(root).expanduser() / namespace
        self.max_bytes = max_bytes
        self._sizes: OrderedDict[str, int] = OrderedDict()     # file name -> bytes, least recently used first
        self._bytes = 0
        self._lock = threading.Lock()     # the engine loop reads while the checkpoint writer writes
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            entries = sorted(self.folder.glob(f"*{SUFFIX}"), key=lambda p: p.stat().st_mtime)
            for path in entries:
                size = path.stat().st_size
                self._sizes[path.name] = size
                self._bytes += size
            for stale in self.folder.glob(".tmp-*"):          # a write interrupted by a crash
                stale.unlink(missing_ok=True)
        except OSError as exc:
            self._failed("open", exc)

    def _path(self, block_hash: bytes) -> Path:
        return self.folder / f"{block_hash.hex()}{SUFFIX}"

    def get(self, block_hash: bytes) -> bytes | None:
        path = self._path(block_hash)
        try:
            value = path.read_bytes()
        except FileNotFoundError:
            self.stats.misses += 1
            return None
        except OSError as exc:
            self._failed("read", exc)
            self.stats.misses += 1
            return None
        self._succeeded()
        self.stats.hits += 1
        with self._lock:
            if path.name in self._sizes:
                self._sizes.move_to_end(path.name)
        try:
            os.utime(path)                # recency survives a restart
        except OSError:
            pass
        return value

    def discard(self, block_hash: bytes) -> None:
        path = self._path(block_hash)
        try:
            path.unlink(missing_ok=True)
        except OSError as exc:
            self._failed("delete", exc)
            return
        with self._lock:
            self._bytes -= self._sizes.pop(path.name, 0)

    def contains(self, block_hash: bytes) -> bool:
        return self._path(block_hash).is_file()

    def put(self, block_hash: bytes, value: bytes) -> bool:
        if len(value) > self.max_bytes:
            self.stats.put_failures += 1
            return False
        path = self._path(block_hash)
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=self.folder)
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(value)
                os.replace(tmp, path)
            except BaseException:
                Path(tmp).unlink(missing_ok=True)
                raise
        except OSError as exc:            # full disk, unwritable folder
            self._failed("write", exc)
            self.stats.put_failures += 1
            return False
        self._succeeded()
        self.stats.puts += 1
        with self._lock:
            self._bytes += len(value) - self._sizes.pop(path.name, 0)
            self._sizes[path.name] = len(value)
            self._evict()
        return True

    def _evict(self) -> None:
        while self._bytes > self.max_bytes and self._sizes:
            name, size = self._sizes.popitem(last=False)
            self._bytes -= size
            try:
                (self.folder / name).unlink(missing_ok=True)
                self.stats.evictions += 1
            except OSError as exc:
                self._failed("evict", exc)

    @property
    def used_bytes(self) -> int:
        return self._bytes
