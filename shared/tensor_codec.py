"""Arrays to ``tensorserve.v1.Tensor`` messages and back: a shared-memory ``TensorRef``
for a peer on this host (shared/shm.py), inline bytes for one on another host."""
from __future__ import annotations

import ipaddress
import math

import numpy as np

from protos.tensorserve.v1 import common_pb2
from shared.shm import DEFAULT_SHM_MIN_BYTES, SHM_DIR, ShmArena, ShmReader, TensorRef, _dtype

__all__ = ["TensorCodec", "resolve_transport", "is_local_address"]



def is_local_address(address: str | None) -> bool:
    """True for a gRPC target on this host: unix sockets, localhost, loopback addresses."""
    if not address:
        return False
    if address.startswith(("unix:", "unix-abstract:")):
        return True
    host = address.split("://", 1)[-1]
    if host.startswith("["):
        host = host[1:host.find("]")]
    elif host.count(":") == 1:
        host = host.rsplit(":", 1)[0]
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def resolve_transport(setting: str | None = None, peer_address: str | None = None) -> str:
    """'shm' or 'inline' from the --tensor-transport value: 'auto' (or None) picks shm for a local peer."""
    value = (setting or "auto").strip().lower()
    if value in ("shm", "inline"):
        return value
    if value == "auto":
        return "shm" if is_local_address(peer_address) and SHM_DIR.is_dir() else "inline"
    raise ValueError(f"tensor transport must be shm, inline or auto, got {value!r}")


class TensorCodec:
    """Arrays to ``tensorserve.v1.Tensor`` messages and back, for one peer (not thread-safe).

    transport "shm": arrays of at least ``shm_min_bytes`` go through this codec's
    arena as TensorRefs, smaller ones inline; "inline": everything inline.
    Decoding accepts both forms whatever the transport. Call ``begin_message()``
    before encoding each message: it recycles the arena.
    """

    def __init__(self, transport: str = "inline", *, arena: ShmArena | None = None,
                 reader: ShmReader | None = None, shm_min_bytes: int = DEFAULT_SHM_MIN_BYTES,
                 copy: bool = True):
        if transport not in ("shm", "inline"):
            raise ValueError(f"transport must be 'shm' or 'inline', got {transport!r}")
        self.transport = transport
        self.shm_min_bytes = shm_min_bytes
        self.copy = copy
        self._arena = arena
        self._reader = reader

    @property
    def arena(self) -> ShmArena | None:
        if self._arena is None and self.transport == "shm":
            self._arena = ShmArena()
        return self._arena

    @property
    def reader(self) -> ShmReader:
        if self._reader is None:
            self._reader = ShmReader()
        return self._reader

    def begin_message(self) -> None:
        if self._arena is not None:
            self._arena.reset()

    def encode_into(self, array, out: common_pb2.Tensor) -> None:
        arr = np.asarray(array)
        if arr.dtype.hasobject:
            raise TypeError(f"cannot send an array of {arr.dtype}")
        if self.transport == "shm" and arr.nbytes >= self.shm_min_bytes:
            ref = self.arena.put(arr)
            r = out.ref
            r.shm_name, r.offset, r.dtype = ref.shm_name, ref.offset, ref.dtype
            r.shape[:] = ref.shape
        else:
            t = out.inline_tensor
            t.dtype = arr.dtype.str
            t.shape[:] = arr.shape
            t.data = arr.tobytes()

    def encode_parts(self, parts, dtype, shape: tuple[int, ...]) -> common_pb2.Tensor:
        """An array given as buffers laid end to end: written into shared memory part by part,
        or joined once for an inline message."""
        out = common_pb2.Tensor()
        dtype = np.dtype(dtype)
        if self.transport == "shm" and math.prod(shape) * dtype.itemsize >= self.shm_min_bytes:
            ref = self.arena.put_parts(parts, dtype, shape)
            r = out.ref
            r.shm_name, r.offset, r.dtype = ref.shm_name, ref.offset, ref.dtype
            r.shape[:] = ref.shape
        else:
            t = out.inline_tensor
            t.dtype, t.data = dtype.str, b"".join(parts)
            t.shape[:] = shape
        return out

    def encode(self, array) -> common_pb2.Tensor:
        out = common_pb2.Tensor()
        self.encode_into(array, out)
        return out

    def decode(self, msg: common_pb2.Tensor) -> np.ndarray:
        kind = msg.WhichOneof("storage")
        if kind == "ref":
            r = msg.ref
            return self.reader.get(TensorRef(r.shm_name, r.offset, r.dtype, tuple(r.shape)), copy=self.copy)
        if kind == "inline_tensor":
            t = msg.inline_tensor
            dtype, shape = _dtype(t.dtype), tuple(t.shape)
            expected = math.prod(shape) * dtype.itemsize
            if len(t.data) != expected or (shape and min(shape) < 0):
                raise ValueError(f"inline tensor of shape {shape} and dtype {t.dtype} needs {expected} bytes, "
                                 f"got {len(t.data)}")
            arr = np.frombuffer(t.data, dtype=dtype).reshape(shape)
            return arr.copy() if self.copy else arr
        raise ValueError("Tensor message has neither a ref nor inline data")

    def close(self) -> None:
        if self._arena is not None:
            self._arena.close()
        if self._reader is not None:
            self._reader.close()
