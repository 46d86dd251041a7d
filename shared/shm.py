"""The tensor transport between processes: arrays in POSIX shared memory, or inline bytes.

Same host: the sender writes an array into its ``ShmArena`` and sends a
``TensorRef`` (segment name, offset, dtype, shape); the receiver's
``ShmReader`` maps the segment (once, cached by name) and copies the array out,
or returns a read-only view. Another host: the bytes travel in the message.
``shared.tensor_codec.TensorCodec`` makes that choice per array and converts to
and from the ``tensorserve.v1.Tensor`` message.

Lifetime. An arena keeps one segment and reuses it for every message: ``reset()``
starts the next message at offset 0. When a message does not fit, the arena
maps a larger segment (at least twice the size) and keeps the old one until the
next ``reset()``, because refs already handed out in this message point into
it; after a few messages one segment sized to the largest message remains. A
ref is therefore valid until its arena's next ``reset()``: request/response
peers (scheduler and worker) read a message before the next one is encoded.

Cleanup. Segment names are ``ts-<pid>-<token>-<n>``: the creating process's
pid, a random token per process (so a recycled pid never reuses a name a
reader may still have mapped) and a counter. A process unlinks what it created
at exit (atexit, and SIGTERM/SIGHUP while their handlers are the default
ones). A process killed with SIGKILL cannot, so ``sweep_stale_segments()``
unlinks every ``ts-*`` segment whose pid is dead (or is our own pid with another
token): the first arena of a process runs it, and process entry points and
supervisors call it at start and when a child dies. Pids are checked in this
process's pid namespace: containers that share /dev/shm must share pids too.

Why not ``multiprocessing.shared_memory.SharedMemory``: before Python 3.13 it
registers every segment, created or only opened, with a resource_tracker
process that unlinks them when *any* user exits (so a reader would destroy the
writer's segment) and warns about "leaked" ones; and its ``close()`` fails while
numpy views are alive. This module uses the same primitive (``_posixshmem``,
CPython's shm_open/shm_unlink) with plain ``mmap`` objects, whose mapping lives
exactly as long as the last array that uses it.
"""
from __future__ import annotations

import atexit
import itertools
import math
import mmap
import os
import re
import secrets
import signal
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import _posixshmem
import numpy as np

__all__ = ["TensorRef", "ShmArena", "ShmReader", "sweep_stale_segments", "cleanup_owned_segments",
           "SHM_DIR", "DEFAULT_SHM_MIN_BYTES"]

SHM_DIR = Path("/dev/shm")
NAME_RE = re.compile(r"^ts-(\d+)-([0-9a-f]+)-(\d+)$")
ALIGN = 64                                   # byte alignment of every array in a segment
DEFAULT_SEGMENT_BYTES = 1 << 20
DEFAULT_SHM_MIN_BYTES = 4096                 # smaller arrays go inline even on the same host


@dataclass(frozen=True)
class TensorRef:
    shm_name: str                # without the leading slash
    offset: int
    dtype: str                   # numpy array-protocol type string, e.g. "<f4"
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * _dtype(self.dtype).itemsize


_dtypes: dict[str, np.dtype] = {}


def _dtype(name: str) -> np.dtype:
    """np.dtype of a wire dtype string, cached (the lookup is a visible part of decoding a small array)."""
    dtype = _dtypes.get(name)
    if dtype is None:
        try:
            dtype = np.dtype(name)
        except TypeError:
            raise ValueError(f"unknown dtype {name!r}") from None
        if dtype.hasobject:
            raise ValueError(f"object dtype {name!r} cannot travel between processes")
        if len(_dtypes) < 256:
            _dtypes[name] = dtype
    return dtype


# ----------------------------------------------------------------- segments this process created
class _Owned:
    """Names this process created and must unlink. Reset in a forked child: the parent owns them."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.token = secrets.token_hex(4)
        self.counter = itertools.count()
        self.names: set[str] = set()
        self.lock = threading.Lock()
        self.hooks_installed = False
        self.swept = False


_owned = _Owned()


def _after_fork_in_child() -> None:
    global _owned
    hooks = _owned.hooks_installed       # signal handlers survive fork; atexit registrations too
    _owned = _Owned()
    _owned.hooks_installed = hooks


os.register_at_fork(after_in_child=_after_fork_in_child)


def _shm_unlink(name: str) -> bool:
    try:
        _posixshmem.shm_unlink("/" + name)
        return True
    except (FileNotFoundError, PermissionError):
        return False


def _create_segment(size: int) -> tuple[str, mmap.mmap]:
    _install_cleanup_hooks()
    owned = _owned
    while True:
        name = f"ts-{owned.pid}-{owned.token}-{next(owned.counter)}"
        try:
            fd = _posixshmem.shm_open("/" + name, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        except FileExistsError:
            continue
        break
    with owned.lock:
        owned.names.add(name)
    try:
        os.ftruncate(fd, size)
        mm = mmap.mmap(fd, size)
    except BaseException:
        _release(name)
        raise
    finally:
        os.close(fd)
    return name, mm


def _release(name: str) -> None:
    _shm_unlink(name)
    with _owned.lock:
        _owned.names.discard(name)


def cleanup_owned_segments() -> None:
    """Unlinks every segment this process created (idempotent; at exit and on SIGTERM/SIGHUP)."""
    owned = _owned
    if owned.pid != os.getpid():
        return
    with owned.lock:
        names = list(owned.names)
        owned.names.clear()
    for name in names:
        _shm_unlink(name)


def _on_fatal_signal(signum: int, frame) -> None:
    cleanup_owned_segments()
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)         # die of the same signal, as without this handler


def _install_cleanup_hooks() -> None:
    if _owned.hooks_installed:
        return
    _owned.hooks_installed = True
    atexit.register(cleanup_owned_segments)
    if threading.current_thread() is not threading.main_thread():
        return                           # signal handlers can only be set from the main thread
    for sig in (signal.SIGTERM, signal.SIGHUP):
        if signal.getsignal(sig) is signal.SIG_DFL:    # never replace a handler someone else set
            signal.signal(sig, _on_fatal_signal)


# ----------------------------------------------------------------- sweeping after crashes
def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True                      # exists, belongs to another user
    try:                                 # a zombie has released its memory: as good as dead
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        return state not in ("Z", "X")
    except (OSError, IndexError):
        return True


def sweep_stale_segments(shm_dir: Path | str = SHM_DIR) -> list[str]:
    """Unlinks the ``ts-*`` segments of dead processes (and of an earlier holder of our own pid).

    Returns the names removed. A no-op where segments cannot be listed (no /dev/shm).
    """
    shm_dir = Path(shm_dir)
    try:
        entries = os.listdir(shm_dir)
    except OSError:
        return []
    me, removed = os.getpid(), []
    for entry in entries:
        m = NAME_RE.match(entry)
        if not m:
            continue
        pid, token = int(m[1]), m[2]
        stale = token != _owned.token if pid == me else not _pid_alive(pid)
        if stale and _shm_unlink(entry):
            removed.append(entry)
    _owned.swept = True
    return removed


def owned_segment_names() -> set[str]:
    return set(_owned.names)


# ----------------------------------------------------------------- writer side
class ShmArena:
    """Reusable shared-memory segments that one sender writes arrays into (not thread-safe)."""

    def __init__(self, initial_bytes: int = DEFAULT_SEGMENT_BYTES, *, sweep: bool = True):
        if initial_bytes < 1:
            raise ValueError(f"initial_bytes must be >= 1, got {initial_bytes}")
        if sweep and not _owned.swept:
            sweep_stale_segments()
        self.initial_bytes = initial_bytes
        self._name: str | None = None
        self._mm: mmap.mmap | None = None
        self._offset = 0
        self._retired: list[tuple[str, mmap.mmap]] = []

    @property
    def segment_names(self) -> list[str]:
        return [n for n, _ in self._retired] + ([self._name] if self._name else [])

    @property
    def capacity(self) -> int:
        return len(self._mm) if self._mm is not None else 0

    def reset(self) -> None:
        """Starts the next message: refs handed out so far become invalid."""
        self._offset = 0
        retired, self._retired = self._retired, []
        for name, mm in retired:
            self._drop(name, mm)

    def put(self, array) -> TensorRef:
        arr = np.asarray(array)
        if arr.dtype.hasobject:
            raise TypeError(f"cannot put an array of {arr.dtype} in shared memory")
        start = -(-self._offset // ALIGN) * ALIGN
        end = start + arr.nbytes
        if self._mm is None or end > len(self._mm):
            self._grow(end if self._mm is not None else arr.nbytes)
            start, end = 0, arr.nbytes
        if arr.nbytes:
            dst = np.ndarray(arr.shape, arr.dtype, buffer=self._mm, offset=start)
            dst[...] = arr
            del dst                      # no export may outlive this call: reset() closes the mmap
        self._offset = end
        return TensorRef(self._name, start, arr.dtype.str, tuple(int(d) for d in arr.shape))

    def put_parts(self, parts: Sequence, dtype, shape: tuple[int, ...]) -> TensorRef:
        """One array written from buffers laid end to end (e.g. stored values' payloads), with no
        joined copy on the way: `parts` must hold exactly the array's bytes."""
        dtype = np.dtype(dtype)
        nbytes = math.prod(shape) * dtype.itemsize
        if sum(memoryview(p).nbytes for p in parts) != nbytes:
            raise ValueError(f"the parts hold {sum(memoryview(p).nbytes for p in parts)} bytes, "
                             f"an array of {shape} {dtype} needs {nbytes}")
        start = -(-self._offset // ALIGN) * ALIGN
        if self._mm is None or start + nbytes > len(self._mm):
            self._grow(start + nbytes if self._mm is not None else nbytes)
            start = 0
        at = start
        for part in parts:
            view = memoryview(part).cast("B")
            self._mm[at:at + view.nbytes] = view
            at += view.nbytes
        self._offset = start + nbytes
        return TensorRef(self._name, start, dtype.str, tuple(int(d) for d in shape))

    def _grow(self, needed: int) -> None:
        size = max(self.initial_bytes, needed, 2 * self.capacity)
        size = 1 << (size - 1).bit_length()
        if self._mm is not None:
            if self._offset:             # refs of this message point into it: keep until reset()
                self._retired.append((self._name, self._mm))
            else:
                self._drop(self._name, self._mm)
        self._name, self._mm = _create_segment(size)
        self._offset = 0

    @staticmethod
    def _drop(name: str, mm: mmap.mmap) -> None:
        _release(name)
        try:
            mm.close()
        except BufferError:
            pass                         # someone holds a view: the mapping goes with it

    def close(self) -> None:
        self.reset()
        if self._mm is not None:
            self._drop(self._name, self._mm)
        self._name, self._mm, self._offset = None, None, 0

    def __enter__(self) -> "ShmArena":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# ----------------------------------------------------------------- reader side
class ShmReader:
    """Maps the segments named by refs, cached by name (not thread-safe)."""

    def __init__(self, max_segments: int = 16):
        self.max_segments = max_segments
        self._maps: OrderedDict[str, mmap.mmap] = OrderedDict()

    def get(self, ref: TensorRef, copy: bool = True) -> np.ndarray:
        """The array a ref names: a copy, or (copy=False) a read-only view valid until the sender's next reset."""
        mm = self._map(ref.shm_name)
        dtype, shape = _dtype(ref.dtype), tuple(ref.shape)
        if (shape and min(shape) < 0) or ref.offset < 0 or ref.offset + ref.nbytes > len(mm):
            raise ValueError(f"{ref.shm_name}: {ref.nbytes} bytes at offset {ref.offset} "
                             f"do not fit in its {len(mm)} bytes")
        arr = np.ndarray(shape, dtype, buffer=mm, offset=ref.offset)
        return arr.copy() if copy else arr

    @property
    def mapped(self) -> list[str]:
        return list(self._maps)

    def _map(self, name: str) -> mmap.mmap:
        mm = self._maps.get(name)
        if mm is not None:
            self._maps.move_to_end(name)
            return mm
        if not NAME_RE.match(name):
            raise ValueError(f"{name!r} is not a TensorServe shared-memory segment (ts-<pid>-<token>-<n>)")
        self._prune()
        try:
            fd = _posixshmem.shm_open("/" + name, os.O_RDONLY, 0)
        except FileNotFoundError:
            raise FileNotFoundError(f"shared-memory segment {name} is gone: its sender exited or reset "
                                    f"its arena before this message was read") from None
        try:
            size = os.fstat(fd).st_size
            if size == 0:
                raise ValueError(f"shared-memory segment {name} is empty")
            mm = mmap.mmap(fd, size, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        self._maps[name] = mm
        while len(self._maps) > self.max_segments:
            self._maps.popitem(last=False)   # the mapping lives on in any view still using it
        return mm

    def _prune(self) -> None:
        """Forgets mappings of segments their sender has unlinked, so their memory can go."""
        if SHM_DIR.is_dir():
            for name in [n for n in self._maps if not (SHM_DIR / n).exists()]:
                del self._maps[name]

    def close(self) -> None:
        self._maps.clear()
