"""How the KV pool holds K and V: one token's row of one KV head in f16, q8_0 or q4_0
(`--kv-cache-dtype`; llama.cpp's `--cache-type-k/-v`, f16 its default).

A pool array is [kv_heads, blocks, block_size, units] of its codec's numpy dtype: float16
values (f16), or ggml's blocks of 32 values (q8_0: an f16 scale `d` and 32 signed codes,
34 bytes; q4_0: `d` and 32 4-bit codes, 18 bytes), as structured dtypes with ggml's byte
layout. The dtype names the codec, so every reader and writer knows it from the array, and
blocks are slices of axis 1 for any codec (copies, export and import). Compiled code sees
every pool array as its bytes, uint8 [kv_heads, blocks, block_size, row_bytes] (`raw`), with
the codec's number: the kernels and the replayed decode region have one signature for all
codecs. Quantized rows are coded with the formulas of ggml's quantize_row_q8_0_ref /
quantize_row_q4_0_ref (gguf.quants gives the same bytes), so the values equal llama.cpp's.

Readers decode rows as they need them (decode_attention.attend one block at a time; a
prompt chunk's batched attention gathers its context once per layer call), never a float
copy of the pool. numba caches each kernel by its own file: after editing the compiled
functions here, delete kernels/cpu/__pycache__'s .nbi/.nbc files (decode attention and the
replayed region compile them in).
"""
from __future__ import annotations

import numpy as np

try:
    from llvmlite import ir
    from numba import njit, types
    from numba.extending import intrinsic
    from numba.core import cgutils
except ImportError:  # pragma: no cover - exercised only where numba is missing
    njit = None

F16, Q8_0, Q4_0 = 0, 1, 2
NAMES = ("f16", "q8_0", "q4_0")
QK = 32                 # values of a q8_0 / q4_0 block
Q8_0_BLOCK = np.dtype([("d", "<f2"), ("qs", "i1", (QK,))])          # ggml's block_q8_0
Q4_0_BLOCK = np.dtype([("d", "<f2"), ("qs", "u1", (QK // 2,))])     # block_q4_0: low nibbles first
DTYPES = (np.dtype("<f2"), Q8_0_BLOCK, Q4_0_BLOCK)


def available() -> bool:
    return njit is not None


def number(name: str) -> int:
    """The codec's number from its name (f16, q8_0, q4_0)."""
    if name not in NAMES:
        raise ValueError(f"unknown KV cache dtype {name!r} (accepted: {', '.join(NAMES)})")
    return NAMES.index(name)


def check_head_dim(name: str, head_dim: int) -> None:
    """Quantized rows are whole ggml blocks: a ValueError where head_dim is no multiple of 32."""
    if number(name) != F16 and head_dim % QK:
        raise ValueError(f"--kv-cache-dtype {name} codes rows in blocks of {QK} values; this model's "
                         f"head_dim {head_dim} is not a multiple of {QK} (use f16)")


def row_bytes(name: str, head_dim: int) -> int:
    """Bytes of one token's K (or V) row of one KV head."""
    check_head_dim(name, head_dim)
    codec = number(name)
    return 2 * head_dim if codec == F16 else head_dim // QK * DTYPES[codec].itemsize


def pool_shape(name: str, num_blocks: int, block_size: int, n_kv_heads: int, head_dim: int) -> tuple[int, ...]:
    check_head_dim(name, head_dim)
    units = head_dim if number(name) == F16 else head_dim // QK
    return n_kv_heads, num_blocks, block_size, units


def codec_of(cache: np.ndarray) -> int:
    """The number of the codec a pool array holds, from its dtype."""
    for codec, dtype in enumerate(DTYPES):
        if cache.dtype == dtype:
            return codec
    raise TypeError(f"a KV cache of dtype {cache.dtype} (expected one of {', '.join(NAMES)})")


def name_of(cache: np.ndarray) -> str:
    return NAMES[codec_of(cache)]


def raw(cache: np.ndarray) -> np.ndarray:
    """A pool array's bytes, uint8 [..., row_bytes] (a view)."""
    return cache.view(np.uint8)


def wire(blocks: np.ndarray) -> np.ndarray:
    """Blocks of a pool array as they travel (export/import, the block format): float16 values for
    f16, the quantized codecs' bytes (uint8 [..., row_bytes]) for the others."""
    return blocks if codec_of(blocks) == F16 else raw(blocks)


def from_wire(array: np.ndarray, name: str) -> np.ndarray:
    """The inverse of `wire` for the codec `name` (a view where the bytes allow)."""
    dtype = DTYPES[number(name)]
    return np.ascontiguousarray(array).view(dtype) if number(name) != F16 else array


def finite_scales(array: np.ndarray, name: str) -> bool:
    """Whether every value (f16) or every block scale (q8_0, q4_0) of `wire`-form blocks is finite:
    one pass over the float16 bits (a restore checks tens of megabytes before the prompt goes on)."""
    halves = np.ascontiguousarray(array).reshape(-1).view(np.uint16)
    stride = 1 if number(name) == F16 else DTYPES[number(name)].itemsize // 2   # a block's scale leads it
    if not available():
        return bool(((halves[::stride] & 0x7C00) != 0x7C00).all())
    return not _any_nonfinite_half(halves, stride)


def store(k_cache: np.ndarray, v_cache: np.ndarray, k: np.ndarray, v: np.ndarray, slots: np.ndarray) -> None:
    """k, v [tokens, kv heads, head_dim] float32 coded into the caches' slots: 0.17 ms a 512-token
    SmolLM2 layer in f16, where numpy's astype(float16) and fancy-indexed copy of the transposed rows
    took 1.05 ms."""
    slots = np.ascontiguousarray(slots, dtype=np.int64)
    _store_rows(raw(k_cache), k, slots, codec_of(k_cache))
    _store_rows(raw(v_cache), v, slots, codec_of(v_cache))


def gather(cache: np.ndarray, blocks: np.ndarray, n_rows: int) -> np.ndarray:
    """The first n_rows rows of the blocks `blocks` (in order) decoded: float32 [kv_heads, n_rows, head_dim]."""
    codec, data = codec_of(cache), raw(cache)
    dim = _values_in(codec, data.shape[3])
    out = np.empty((data.shape[0], n_rows, dim), np.float32)
    _gather(data, np.ascontiguousarray(blocks, dtype=np.int64), codec, out)
    return out


def _values_in(codec, n_bytes):  # pragma: no cover - compiled too (values_in)
    """Values in a row of n_bytes bytes."""
    if codec == F16:
        return n_bytes // 2
    return n_bytes // (34 if codec == Q8_0 else 18) * QK


def _roundf(x):  # pragma: no cover - numba
    """C's roundf (halves away from zero), exact: x + 0.5 is exact in float64."""
    a = np.floor(abs(np.float64(x)) + 0.5)
    return -a if x < 0 else a


def encode_row(src, dst, codec):  # pragma: no cover - numba
    """dst (uint8 [row_bytes]) = the float32 row src coded; every byte is written once with its final
    value (a replay's threads may code the same row together)."""
    if codec == F16:
        for j in range(src.shape[0]):
            h = float_to_half(src[j])
            dst[2 * j], dst[2 * j + 1] = np.uint8(h & 0xFF), np.uint8(h >> 8)
        return
    size = 34 if codec == Q8_0 else 18
    for blk in range(src.shape[0] // QK):
        x = src[blk * QK:(blk + 1) * QK]
        at = blk * size
        if codec == Q8_0:       # quantize_row_q8_0_ref
            amax = np.float32(0.0)
            for j in range(QK):
                amax = max(amax, abs(x[j]))
            d = amax / np.float32(127.0)
            inv = np.float32(1.0) / d if d != 0 else np.float32(0.0)
            for j in range(QK):
                dst[at + 2 + j] = np.uint8(np.int64(_roundf(x[j] * inv)) & 0xFF)
        else:                   # quantize_row_q4_0_ref: the value of largest magnitude codes to -8
            amax, vmax = np.float32(0.0), np.float32(0.0)
            for j in range(QK):
                if amax < abs(x[j]):
                    amax, vmax = abs(x[j]), x[j]
            d = vmax / np.float32(-8.0)
            inv = np.float32(1.0) / d if d != 0 else np.float32(0.0)
            for j in range(QK // 2):
                lo = min(15, np.int64(x[j] * inv + np.float32(8.5)))
                hi = min(15, np.int64(x[j + QK // 2] * inv + np.float32(8.5)))
                dst[at + 2 + j] = np.uint8(lo | (hi << 4))
        h = float_to_half(d)
        dst[at], dst[at + 1] = np.uint8(h & 0xFF), np.uint8(h >> 8)


def decode_rows(cache, kv, block, j0, j1, codec, out):  # pragma: no cover - numba
    """out[j] = row j of block `block` of KV head kv, decoded, for j0 <= j < j1 (out: float32
    [>= j1, head_dim]). Rows are indexed, not taken as views (a view is a reference count in the loop)."""
    dim = out.shape[1]
    if codec == F16:
        for j in range(j0, j1):
            for i in range(dim):
                out[j, i] = half_to_float(np.uint16(cache[kv, block, j, 2 * i])
                                          | (np.uint16(cache[kv, block, j, 2 * i + 1]) << 8))
        return
    size = 34 if codec == Q8_0 else 18
    for j in range(j0, j1):
        for blk in range(dim // QK):
            at = blk * size
            d = half_to_float(np.uint16(cache[kv, block, j, at]) | (np.uint16(cache[kv, block, j, at + 1]) << 8))
            base = blk * QK
            # a trip count LLVM does not know (always QK): a constant 32 is unrolled into scalar
            # conversions, this one vectorized (q8_0 rows of 256 values decoded ~2x as fast)
            n = min(QK, dim - base)
            if codec == Q8_0:
                for i in range(n):
                    out[j, base + i] = np.float32(np.int8(cache[kv, block, j, at + 2 + i])) * d
            else:
                for i in range(n // 2):
                    q = cache[kv, block, j, at + 2 + i]
                    out[j, base + i] = np.float32(np.int32(q & 0xF) - 8) * d
                    out[j, base + i + QK // 2] = np.float32(np.int32(q >> 4) - 8) * d


def _store_rows(cache, rows, slots, codec):  # pragma: no cover - numba
    block_size = cache.shape[2]
    for t in range(rows.shape[0]):
        block, offset = slots[t] // block_size, slots[t] % block_size
        for h in range(cache.shape[0]):
            encode_row(rows[t, h], cache[h, block, offset], codec)


def _any_nonfinite_half(halves, stride):  # pragma: no cover - numba
    bad = 0
    if stride == 1:                                 # a plain loop: vectorized
        for i in range(halves.shape[0]):
            bad |= (halves[i] & 0x7C00) == 0x7C00  # exponent all ones: infinity or NaN
    else:
        for i in range(0, halves.shape[0], stride):
            bad |= (halves[i] & 0x7C00) == 0x7C00
    return bad != 0


def _gather(cache, blocks, codec, out):  # pragma: no cover - numba
    block_size, n_rows = cache.shape[2], out.shape[1]
    scratch = np.empty((block_size, out.shape[2]), np.float32)
    for h in range(cache.shape[0]):
        for i in range(blocks.shape[0]):
            n = min(block_size, n_rows - i * block_size)
            if n <= 0:
                break
            decode_rows(cache, h, blocks[i], 0, n, codec, scratch)
            out[h, i * block_size:i * block_size + n] = scratch[:n]


if available():
    @intrinsic
    def half_to_float(typingctx, bits):
        """The float16 value with bits `bits` (uint16) as float32: vcvtph2ps (F16C) in vector loops."""
        def codegen(context, builder, signature, args):
            return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())
        return types.float32(types.uint16), codegen

    @intrinsic
    def float_to_half(typingctx, value):
        """The bits of float32 `value` rounded to float16 (nearest, ties to even; inf past 65504), as
        F16C's conversion and ggml's GGML_FP32_TO_FP16 round."""
        def codegen(context, builder, signature, args):
            return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), ir.IntType(16))
        return types.uint16(types.float32), codegen

    @intrinsic
    def prefetch_block(typingctx, cache, kv, block):
        """Asks for block `block` of KV head kv of a pool (its bytes, uint8 [n_kv, blocks,
        block_size, row bytes]) to be brought into the cache ahead of its use: a block is a few KiB
        at an address the table picks, where the hardware's own prefetch does not reach."""
        def codegen(context, builder, signature, args):
            cache_a, kv_v, block_v = args
            i8p, i32, i64 = ir.IntType(8).as_pointer(), ir.IntType(32), ir.IntType(64)
            arr = context.make_array(signature.args[0])(context, builder, cache_a)
            strides = cgutils.unpack_tuple(builder, arr.strides)
            shape = cgutils.unpack_tuple(builder, arr.shape)
            base = builder.gep(builder.bitcast(arr.data, i8p),
                               [builder.add(builder.mul(kv_v, strides[0]), builder.mul(block_v, strides[1]))])
            size = builder.mul(shape[2], strides[2])
            fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32]),
                                                "llvm.prefetch.p0i8")
            with cgutils.for_range_slice(builder, i64(0), size, i64(64)) as (at, _):
                builder.call(fn, [builder.gep(base, [at]), i32(0), i32(3), i32(1)])
            return context.get_dummy_value()
        return types.void(cache, kv, block), codegen

    values_in = njit(inline="always")(_values_in)
    _roundf = njit(inline="always")(_roundf)
    encode_row = njit(inline="always")(encode_row)
    decode_rows = njit(inline="always")(decode_rows)
    _store_rows = njit(cache=True, nogil=True)(_store_rows)
    _gather = njit(cache=True, nogil=True)(_gather)
    _any_nonfinite_half = njit(cache=True, nogil=True)(_any_nonfinite_half)


def warm_up() -> None:
    """Compile (or load from numba's cache) the stores and the gather, with the argument types the
    forward passes give them (K and V views of a fused projection; 'C' for one row)."""
    if not available():
        return
    cache = np.zeros(pool_shape("q8_0", 1, 16, 1, 32), Q8_0_BLOCK)
    for rows in (1, 2):
        fused = np.zeros((rows, 96), np.float32)
        store(cache, cache, fused[:, 32:64].reshape(rows, 1, 32), fused[:, 64:].reshape(rows, 1, 32),
              np.zeros(rows, np.int64))
    gather(cache, np.zeros(1, np.int64), 16)
