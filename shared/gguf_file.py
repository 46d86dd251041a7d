"""Memory-mapped GGUF reading: metadata, tensor directory and zero-copy tensor bytes.

gguf-py's GGUFReader builds one numpy view per array element, which takes about
15 s on Gemma 3's 262144-entry vocabulary; this reader parses the header with
struct and numpy (well under a second) and uses gguf-py for the format's
constants (value types, tensor types, block sizes).
"""
from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

from shared.errors import GGUFError

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32

_SCALAR_FORMATS = {
    GGUFValueType.UINT8: "<B", GGUFValueType.INT8: "<b",
    GGUFValueType.UINT16: "<H", GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I", GGUFValueType.INT32: "<i",
    GGUFValueType.FLOAT32: "<f", GGUFValueType.BOOL: "<?",
    GGUFValueType.UINT64: "<Q", GGUFValueType.INT64: "<q",
    GGUFValueType.FLOAT64: "<d",
}
_NUMPY_TYPES = {
    GGUFValueType.UINT8: np.uint8, GGUFValueType.INT8: np.int8,
    GGUFValueType.UINT16: np.uint16, GGUFValueType.INT16: np.int16,
    GGUFValueType.UINT32: np.uint32, GGUFValueType.INT32: np.int32,
    GGUFValueType.FLOAT32: np.float32, GGUFValueType.BOOL: np.bool_,
    GGUFValueType.UINT64: np.uint64, GGUFValueType.INT64: np.int64,
    GGUFValueType.FLOAT64: np.float64,
}


@dataclass(frozen=True)
class TensorInfo:
    name: str
    ggml_type: int
    shape: tuple[int, ...]   # numpy order: the contiguous GGML ne[0] is last
    offset: int              # absolute byte offset in the file
    nbytes: int

    @property
    def type_name(self) -> str:
        try:
            return GGMLQuantizationType(self.ggml_type).name
        except ValueError:
            return f"{self.ggml_type} (unknown GGML type)"


class _Cursor:
    def __init__(self, buf: np.ndarray, path: Path):
        self.buf, self.pos, self.path = buf, 0, path

    def take(self, n: int) -> memoryview:
        end = self.pos + n
        if end > len(self.buf):
            raise GGUFError(self.path, f"truncated header: needed {n} bytes at offset {self.pos}, "
                                       f"file has {len(self.buf)} bytes; re-download or re-convert the model")
        view = memoryview(self.buf[self.pos:end])
        self.pos = end
        return view

    def scalar(self, fmt: str) -> Any:
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        n = self.scalar("<Q")
        return bytes(self.take(n)).decode("utf-8", errors="replace")

    def value(self, vtype: int) -> Any:
        vtype = GGUFValueType(vtype)
        if vtype == GGUFValueType.STRING:
            return self.string()
        if vtype == GGUFValueType.ARRAY:
            elem_type = GGUFValueType(self.scalar("<I"))
            count = self.scalar("<Q")
            if elem_type == GGUFValueType.STRING:
                return [self.string() for _ in range(count)]
            if elem_type == GGUFValueType.ARRAY:
                return [self.value(GGUFValueType.ARRAY) for _ in range(count)]
            dtype = np.dtype(_NUMPY_TYPES[elem_type]).newbyteorder("<")
            raw = self.take(count * dtype.itemsize)
            return np.frombuffer(raw, dtype=dtype).tolist()
        return self.scalar(_SCALAR_FORMATS[vtype])


class GGUFFile:
    """A GGUF file opened read-only with mmap; tensor bytes are views into the map."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not self.path.is_file():
            raise GGUFError(self.path, "no such file")
        try:
            self._map = np.memmap(self.path, dtype=np.uint8, mode="r")
        except ValueError:  # an empty file cannot be mapped
            raise GGUFError(self.path, "not a GGUF file (it is empty)") from None
        cur = _Cursor(self._map, self.path)
        if len(self._map) < 4 or bytes(self._map[:4]) != GGUF_MAGIC:
            raise GGUFError(self.path, f"not a GGUF file (magic {bytes(self._map[:4])!r}, expected b'GGUF')")
        cur.take(4)
        self.version = cur.scalar("<I")
        if self.version not in (2, 3):
            raise GGUFError(self.path, f"unsupported GGUF version {self.version} (supported: 2, 3)")
        n_tensors, n_kv = cur.scalar("<Q"), cur.scalar("<Q")
        try:
            self.metadata: dict[str, Any] = {}
            for _ in range(n_kv):
                key = cur.string()
                self.metadata[key] = cur.value(cur.scalar("<I"))
            raw_infos = []
            for _ in range(n_tensors):
                name = cur.string()
                n_dims = cur.scalar("<I")
                dims = [cur.scalar("<Q") for _ in range(n_dims)]
                raw_infos.append((name, dims, cur.scalar("<I"), cur.scalar("<Q")))
        except GGUFError:   # already says what is wrong (a truncated header)
            raise
        except (ValueError, KeyError) as exc:
            raise GGUFError(self.path, f"corrupt header ({exc})") from None
        alignment = int(self.metadata.get("general.alignment", DEFAULT_ALIGNMENT))
        self.data_offset = -(-cur.pos // alignment) * alignment
        self.tensors: dict[str, TensorInfo] = {}
        for name, dims, ggml_type, rel_offset in raw_infos:
            shape = tuple(int(d) for d in reversed(dims))
            self.tensors[name] = TensorInfo(name, ggml_type, shape, self.data_offset + rel_offset,
                                            _tensor_nbytes(ggml_type, dims))
        self._check_extent()

    def _check_extent(self) -> None:
        size = len(self._map)
        for t in self.tensors.values():
            if t.nbytes >= 0 and t.offset + t.nbytes > size:
                raise GGUFError(self.path, f"truncated: tensor {t.name!r} needs bytes up to "
                                           f"{t.offset + t.nbytes} but the file has {size}; "
                                           "the download or conversion was cut short")

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", ""))

    def raw(self, name: str) -> np.ndarray:
        """The tensor's bytes as a read-only uint8 view of the mapped file (no copy)."""
        t = self.tensors[name]
        return self._map[t.offset:t.offset + t.nbytes]

    def __repr__(self) -> str:
        return f"GGUFFile({str(self.path)!r}, arch={self.architecture!r}, tensors={len(self.tensors)})"


def _tensor_nbytes(ggml_type: int, dims: list[int]) -> int:
    """Bytes a tensor occupies, or -1 for a type unknown to gguf-py (reported when it is used)."""
    try:
        block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
    except (ValueError, KeyError):
        return -1
    n = int(np.prod(dims, dtype=np.int64)) if dims else 1
    return n // block * type_size
