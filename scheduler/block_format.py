"""One KV block as one stored value (a prefix checkpoint's unit, in Redis or on disk):

    magic "TSKV" | format version (u16) | header length (u32) | header (JSON) | payload | xxh3-128

The header names everything the payload depends on: the model fingerprint, the KV codec, the
block size, the layer count and K/V geometry, the block's hash and its parent's, and its token
ids. The payload is each layer's [2 (K, V), kv_heads, block_size, width] array in the codec's
layout, layer after layer: float values (width head_dim) for f32 and f16, the bytes of ggml's
blocks of 32 values (width = a row's bytes: 34 per block for q8_0, 18 for q4_0) for the
quantized codecs. The checksum covers everything before it, so one value is written
whole or read as a miss: a block is never two keys that could disagree. It is xxh3-128, not a
cryptographic hash: it guards against truncation and bit rot at memory speed (a restore checks
tens of megabytes on the request's critical path); the stores are the operator's, not a client's.

`decode` accepts a value only if it checks out against what this server would have written:
anything else (another model, codec, block size or format version, a truncated value, a flipped
byte, token ids that do not hash to the block's hash) raises `BlockRejected`, which the stores
count as a miss, never an error for the request. Values that are not finite (a block saved from a
pass that overflowed) are refused by the worker at import; `holds_nonfinite` finds the block.
"""
from __future__ import annotations

import json
import struct
from dataclasses import dataclass

import numpy as np
import xxhash

from scheduler.block_manager import block_hash

MAGIC = b"TSKV"
VERSION = 2                                 # 2: xxh3-128 checksum (1: sha256)
_PREFIX = struct.Struct("<4sHI")            # magic, version, header length
_CHECKSUM_BYTES = 16                        # xxh3-128
CODEC_DTYPES = {"f32": "<f4", "f16": "<f2", "q8_0": "u1", "q4_0": "u1"}
# the quantized codecs: bytes of one block of 32 values (a float16 scale and the codes)
QUANTIZED_BLOCK_BYTES = {"q8_0": 34, "q4_0": 18}


class BlockRejected(ValueError):
    """A stored value that is not a usable block for this server; the message says why."""


@dataclass(frozen=True)
class Geometry:
    """What a block must match to be used by this server."""
    fingerprint: str
    codec: str
    block_size: int
    n_layers: int
    kv_heads: int
    head_dim: int

    @property
    def namespace(self) -> str:
        """Where a store keeps this geometry's blocks: blocks of another model, codec, block size or
        format version are never read (a value that is read and rejected is then damaged)."""
        return f"{self.fingerprint}-{self.codec}-b{self.block_size}-v{VERSION}"

    @property
    def width(self) -> int:
        """Elements of one token's K (or V) row of one KV head in the payload."""
        if self.codec in QUANTIZED_BLOCK_BYTES:
            return self.head_dim // 32 * QUANTIZED_BLOCK_BYTES[self.codec]
        return self.head_dim

    @property
    def layer_shape(self) -> tuple[int, int, int, int]:
        return 2, self.kv_heads, self.block_size, self.width

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(CODEC_DTYPES[self.codec])

    @property
    def payload_bytes(self) -> int:
        return self.n_layers * int(np.prod(self.layer_shape)) * self.dtype.itemsize


@dataclass(frozen=True)
class KVBlock:
    geometry: Geometry
    block_hash: bytes
    parent_hash: bytes | None
    token_ids: tuple[int, ...]
    payload: bytes | memoryview            # every layer's [2, kv_heads, block_size, width], layer after layer

    @classmethod
    def from_layers(cls, geometry: Geometry, block_hash: bytes, parent_hash: bytes | None,
                    token_ids: tuple[int, ...], layers) -> "KVBlock":
        if len(layers) != geometry.n_layers or any(tuple(a.shape) != geometry.layer_shape for a in layers):
            raise ValueError(f"a block of {geometry.n_layers} layers shaped {geometry.layer_shape} was expected")
        payload = b"".join(np.ascontiguousarray(a, dtype=geometry.dtype).tobytes() for a in layers)
        return cls(geometry, block_hash, parent_hash, tuple(token_ids), payload)

    @property
    def layers(self) -> tuple[np.ndarray, ...]:
        """Read-only views of the payload, one [2, kv_heads, block_size, width] array a layer."""
        g = self.geometry
        return tuple(np.frombuffer(self.payload, dtype=g.dtype).reshape(g.n_layers, *g.layer_shape))


def encode(block: KVBlock) -> bytes:
    g = block.geometry
    if memoryview(block.payload).nbytes != g.payload_bytes:
        raise ValueError(f"a payload of {g.payload_bytes} bytes was expected, got {memoryview(block.payload).nbytes}")
    if len(block.token_ids) != g.block_size:
        raise ValueError(f"a full block holds {g.block_size} token ids, got {len(block.token_ids)}")
    header = json.dumps({
        "fingerprint": g.fingerprint, "codec": g.codec, "block_size": g.block_size, "n_layers": g.n_layers,
        "kv_heads": g.kv_heads, "head_dim": g.head_dim, "hash": block.block_hash.hex(),
        "parent": block.parent_hash.hex() if block.parent_hash is not None else None,
        "token_ids": [int(t) for t in block.token_ids]}, separators=(",", ":")).encode()
    body = b"".join((_PREFIX.pack(MAGIC, VERSION, len(header)), header, block.payload))
    return body + xxhash.xxh3_128_digest(body)


def decode(value: bytes, expect: Geometry) -> KVBlock:
    """The block in `value`, if it is one this server wrote for this model; else BlockRejected."""
    if len(value) < _PREFIX.size + _CHECKSUM_BYTES:
        raise BlockRejected(f"truncated ({len(value)} bytes)")
    magic, version, header_len = _PREFIX.unpack_from(value)
    if magic != MAGIC:
        raise BlockRejected("not a TensorServe KV block")
    if version != VERSION:
        raise BlockRejected(f"format version {version}; this server reads version {VERSION}")
    view = memoryview(value)
    body, checksum = view[:-_CHECKSUM_BYTES], bytes(view[-_CHECKSUM_BYTES:])
    if xxhash.xxh3_128_digest(body) != checksum:
        raise BlockRejected("checksum mismatch (truncated or altered)")
    try:
        header = json.loads(bytes(body[_PREFIX.size:_PREFIX.size + header_len]))
        got = Geometry(str(header["fingerprint"]), str(header["codec"]), int(header["block_size"]),
                       int(header["n_layers"]), int(header["kv_heads"]), int(header["head_dim"]))
        digest = bytes.fromhex(header["hash"])
        parent = bytes.fromhex(header["parent"]) if header["parent"] is not None else None
        token_ids = tuple(int(t) for t in header["token_ids"])
    except (ValueError, KeyError, TypeError) as exc:
        raise BlockRejected(f"unreadable header ({exc})") from None
    for name in ("fingerprint", "codec", "block_size", "n_layers", "kv_heads", "head_dim"):
        if getattr(got, name) != getattr(expect, name):
            raise BlockRejected(f"another {name.replace('_', ' ')}: {getattr(got, name)!r}, this server uses "
                                f"{getattr(expect, name)!r}")
    if len(token_ids) != expect.block_size:
        raise BlockRejected(f"{len(token_ids)} token ids in a block of {expect.block_size}")
    if block_hash(expect.fingerprint.encode(), parent, token_ids) != digest:
        raise BlockRejected("its token ids do not hash to its block hash")
    payload = body[_PREFIX.size + header_len:]
    if len(payload) != expect.payload_bytes:
        raise BlockRejected(f"payload of {len(payload)} bytes, the geometry needs {expect.payload_bytes}")
    # whether the values are finite is the worker's check, on every import (one pass over the
    # float bits, where numpy here would take a pass per block); `holds_nonfinite` then tells
    # which stored block it was
    return KVBlock(expect, digest, parent, token_ids, payload)


def holds_nonfinite(block: KVBlock) -> bool:
    """Whether a block's K/V hold NaN or infinity: any value (f32, f16), or any quantized block's
    float16 scale (its codes are integers)."""
    g = block.geometry
    flat = np.frombuffer(block.payload, dtype=g.dtype)
    if g.codec in QUANTIZED_BLOCK_BYTES:
        flat = np.ascontiguousarray(flat.reshape(-1, QUANTIZED_BLOCK_BYTES[g.codec])[:, :2]).view("<f2")
    return not bool(np.isfinite(flat).all())
