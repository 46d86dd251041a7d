"""Vectorized dequantization of GGML tensor data to float32.

All supported types are decoded by numpy kernels in this module (no Python
loop per block).  The bit layouts follow ggml's C reference code
(``dequantize_row_*`` in ``ggml/src/ggml-quants.c``, block structs in
``ggml-common.h``), and the arithmetic is done in float32 in the same order as
the C code, so results are bit-identical to ggml's scalar reference.

Why not ``gguf.quants.dequantize``?  Its decoders are correct for these types
(tests/test_dequant.py checks that too), but it works on groups of 16 rows and
``np.concatenate``s a Python list of per-group results, so it holds roughly two
copies of the output at once, spends a lot of time in Python overhead for
tables with many short rows (262144x640 embeddings) and makes several full
float32 temporaries per block.  The kernels here write straight into a
preallocated output, one bounded chunk of blocks at a time, so peak memory is
the output plus a few MiB.

Public API
----------
``SUPPORTED_TYPES``   frozenset of GGMLQuantizationType values handled here.
``dequantize(raw, ggml_type, shape)``  whole tensor -> new float32 array.
``dequantize_rows(raw, ggml_type, shape, rows)``  only the given rows.
``row_bytes(ggml_type, n_cols)``  bytes per row of ``n_cols`` elements.
``UnsupportedTensorType``  ValueError raised for any other type.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

__all__ = [
    "SUPPORTED_TYPES",
    "UnsupportedTensorType",
    "dequantize",
    "dequantize_rows",
    "row_bytes",
    "type_name",
]

T = GGMLQuantizationType
QK_K = 256

# Upper bound on the number of output elements decoded in one step.  Each step
# allocates a handful of temporaries about this many bytes (uint8/int8) plus
# one float32 temporary for a few types, so 1 Mi elements keeps the extra
# memory to a few tens of MiB while amortising numpy's per-call overhead.
_CHUNK_ELEMS = 1 << 20


class UnsupportedTensorType(ValueError):
    """Raised for GGML tensor types this module cannot dequantize."""


def type_name(ggml_type: int) -> str:
    try:
        return T(int(ggml_type)).name
    except ValueError:
        return f"unknown GGML type {int(ggml_type)}"


# --------------------------------------------------------------------------
# helpers


def _f16_field(blocks: np.ndarray, offset: int) -> np.ndarray:
    """fp16 field at byte ``offset`` of every block -> float32 (n_blocks, 1)."""
    return blocks[:, offset:offset + 2].view(np.float16).astype(np.float32)


_SHIFT_2BIT = np.array([0, 2, 4, 6], dtype=np.uint8)
_SHIFT_NIBBLE = np.array([0, 4], dtype=np.uint8)
_SHIFT_BITS = np.arange(8, dtype=np.uint8)


def _nibbles_split16(qs: np.ndarray) -> np.ndarray:
    """(n, 16) bytes -> (n, 32) uint8: low nibbles then high nibbles (Q4_0/Q4_1/Q5 layout)."""
    n = qs.shape[0]
    q = np.empty((n, 32), dtype=np.uint8)
    np.bitwise_and(qs, 0x0F, out=q[:, :16])
    np.right_shift(qs, 4, out=q[:, 16:])
    return q


# --------------------------------------------------------------------------
# kernels: (blocks uint8 (n, type_size), out float32 (n, block_size)) -> None


def _k_q4_0(b: np.ndarray, out: np.ndarray) -> None:
    # block_q4_0 { fp16 d; uint8 qs[16]; }   y = ((q & 15) - 8) * d
    d = _f16_field(b, 0)
    q = _nibbles_split16(b[:, 2:18]).view(np.int8)
    q -= 8
    np.multiply(q, d, out=out)


def _k_q4_1(b: np.ndarray, out: np.ndarray) -> None:
    # block_q4_1 { fp16 d; fp16 m; uint8 qs[16]; }   y = q * d + m
    d = _f16_field(b, 0)
    m = _f16_field(b, 2)
    q = _nibbles_split16(b[:, 4:20])
    np.multiply(q, d, out=out)
    out += m


def _q5_quants(qh: np.ndarray, qs: np.ndarray) -> np.ndarray:
    # element j (0..31) gets bit j of the little-endian uint32 qh as bit 4
    q = _nibbles_split16(qs)
    hb = np.unpackbits(qh, axis=1, bitorder="little")  # (n, 32), element j = bit j
    hb <<= 4
    q |= hb
    return q


def _k_q5_0(b: np.ndarray, out: np.ndarray) -> None:
    # block_q5_0 { fp16 d; uint8 qh[4]; uint8 qs[16]; }   y = (q - 16) * d
    d = _f16_field(b, 0)
    q = _q5_quants(b[:, 2:6], b[:, 6:22]).view(np.int8)
    q -= 16
    np.multiply(q, d, out=out)


def _k_q5_1(b: np.ndarray, out: np.ndarray) -> None:
    # block_q5_1 { fp16 d; fp16 m; uint8 qh[4]; uint8 qs[16]; }   y = q * d + m
    d = _f16_field(b, 0)
    m = _f16_field(b, 2)
    q = _q5_quants(b[:, 4:8], b[:, 8:24])
    np.multiply(q, d, out=out)
    out += m


def _k_q8_0(b: np.ndarray, out: np.ndarray) -> None:
    # block_q8_0 { fp16 d; int8 qs[32]; }   y = q * d
    d = _f16_field(b, 0)
    np.multiply(b[:, 2:34].view(np.int8), d, out=out)


def _k_q2_k(b: np.ndarray, out: np.ndarray) -> None:
    # block_q2_K { uint8 scales[16]; uint8 qs[64]; fp16 d; fp16 dmin; }
    # output 16-group g uses scales[g]; element (h, j, l) of half h, shift 2j,
    # l in 0..31 is (qs[32h + l] >> 2j) & 3.
    n = b.shape[0]
    sc = b[:, 0:16]
    d = _f16_field(b, 80)
    dmin = _f16_field(b, 82)
    dl = (d * (sc & 0x0F))[:, :, None]          # float32 (n, 16, 1)
    ml = (dmin * (sc >> 4))[:, :, None]
    q = b[:, 16:80].reshape(n, 2, 1, 32) >> _SHIFT_2BIT.reshape(1, 1, 4, 1)
    q &= 3
    o = out.reshape(n, 16, 16)
    np.multiply(q.reshape(n, 16, 16), dl, out=o)
    o -= ml


def _k_q3_k(b: np.ndarray, out: np.ndarray) -> None:
    # block_q3_K { uint8 hmask[32]; uint8 qs[64]; uint8 scales[12]; fp16 d; }
    n = b.shape[0]
    hmask = b[:, 0:32]
    qs = b[:, 32:96]
    sc = b[:, 96:108]
    d = _f16_field(b, 108)
    # 16 six-bit scales: low nibble from sc[0..7] (low nibbles then high
    # nibbles), high 2 bits from sc[8 + s%4] >> 2*(s//4).
    lo = np.concatenate([sc[:, 0:8] & 0x0F, sc[:, 0:8] >> 4], axis=1)
    hi = (sc[:, None, 8:12] >> _SHIFT_2BIT.reshape(1, 4, 1)) & 3
    s = (lo | (hi.reshape(n, 16) << 4)).view(np.int8)
    s -= 32
    dl = (d * s)[:, :, None]                     # float32 (n, 16, 1)
    # element (h, j, l): ((qs[32h + l] >> 2j) & 3) - (hmask[l] bit (4h + j) ? 0 : 4)
    q = qs.reshape(n, 2, 1, 32) >> _SHIFT_2BIT.reshape(1, 1, 4, 1)
    q &= 3
    hb = hmask.reshape(n, 1, 32) >> _SHIFT_BITS.reshape(1, 8, 1)  # (n, 8, 32), bit 4h+j
    hb &= 1
    hb <<= 2
    q |= hb.reshape(n, 2, 4, 32)
    qi = q.view(np.int8)
    qi -= 4
    np.multiply(qi.reshape(n, 16, 16), dl, out=out.reshape(n, 16, 16))


def _k4_scales_mins(b: np.ndarray, d: np.ndarray, dmin: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """get_scale_min_k4 for all 8 sub-blocks -> (d*sc, dmin*m) float32 (n, 8, 1)."""
    n = b.shape[0]
    s0 = b[:, 4:8]
    s1 = b[:, 8:12]
    s2 = b[:, 12:16]
    sc = np.empty((n, 8), dtype=np.uint8)
    mn = np.empty((n, 8), dtype=np.uint8)
    np.bitwise_and(s0, 63, out=sc[:, 0:4])
    np.bitwise_and(s1, 63, out=mn[:, 0:4])
    sc[:, 4:8] = (s2 & 0x0F) | ((s0 >> 6) << 4)
    mn[:, 4:8] = (s2 >> 4) | ((s1 >> 6) << 4)
    return (d * sc)[:, :, None], (dmin * mn)[:, :, None]


def _k_q4_k(b: np.ndarray, out: np.ndarray) -> None:
    # block_q4_K { fp16 d; fp16 dmin; uint8 scales[12]; uint8 qs[128]; }
    # sub-block s (32 values): nibble s%2 of qs[32*(s//2) + l]
    n = b.shape[0]
    d = _f16_field(b, 0)
    dmin = _f16_field(b, 2)
    dl, ml = _k4_scales_mins(b, d, dmin)
    q = b[:, 16:144].reshape(n, 4, 1, 32) >> _SHIFT_NIBBLE.reshape(1, 1, 2, 1)
    q &= 0x0F
    o = out.reshape(n, 8, 32)
    np.multiply(q.reshape(n, 8, 32), dl, out=o)
    o -= ml


def _k_q5_k(b: np.ndarray, out: np.ndarray) -> None:
    # block_q5_K { fp16 d; fp16 dmin; uint8 scales[12]; uint8 qh[32]; uint8 qs[128]; }
    # sub-block s: nibble as Q4_K, plus 16 if bit s of qh[l] is set
    n = b.shape[0]
    d = _f16_field(b, 0)
    dmin = _f16_field(b, 2)
    dl, ml = _k4_scales_mins(b, d, dmin)
    q = b[:, 48:176].reshape(n, 4, 1, 32) >> _SHIFT_NIBBLE.reshape(1, 1, 2, 1)
    q &= 0x0F
    q = q.reshape(n, 8, 32)
    hb = b[:, 16:48].reshape(n, 1, 32) >> _SHIFT_BITS.reshape(1, 8, 1)
    hb &= 1
    hb <<= 4
    q |= hb
    o = out.reshape(n, 8, 32)
    np.multiply(q, dl, out=o)
    o -= ml


def _k_q6_k(b: np.ndarray, out: np.ndarray) -> None:
    # block_q6_K { uint8 ql[128]; uint8 qh[64]; int8 scales[16]; fp16 d; }
    # element (h, k, l), k in 0..3: low 4 bits = nibble k//2 of ql[64h + 32(k%2) + l],
    # high 2 bits = (qh[32h + l] >> 2k) & 3; value - 32; 16-group g uses scales[g].
    n = b.shape[0]
    d = _f16_field(b, 208)
    dl = (d * b[:, 192:208].view(np.int8))[:, :, None]   # float32 (n, 16, 1)
    lo = b[:, 0:128].reshape(n, 2, 1, 64) >> _SHIFT_NIBBLE.reshape(1, 1, 2, 1)  # (n, 2, 2, 64) = (h, k//2, k%2*32 + l)
    lo &= 0x0F
    hi = b[:, 128:192].reshape(n, 2, 1, 32) >> _SHIFT_2BIT.reshape(1, 1, 4, 1)   # (n, 2, 4, 32)
    hi &= 3
    hi <<= 4
    q = lo.reshape(n, 2, 4, 32)
    q |= hi
    qi = q.view(np.int8)
    qi -= 32
    np.multiply(qi.reshape(n, 16, 16), dl, out=out.reshape(n, 16, 16))


def _k_f16(b: np.ndarray, out: np.ndarray) -> None:
    np.copyto(out, b.view(np.float16))


def _k_bf16(b: np.ndarray, out: np.ndarray) -> None:
    # bf16 is the top half of an IEEE float32 (ggml_compute_bf16_to_fp32)
    o = out.view(np.uint32)
    np.copyto(o, b.view(np.uint16))
    o <<= 16


def _k_f32(b: np.ndarray, out: np.ndarray) -> None:
    np.copyto(out, b.view(np.float32))


_KERNELS: dict[int, Callable[[np.ndarray, np.ndarray], None]] = {
    int(T.F32): _k_f32,
    int(T.F16): _k_f16,
    int(T.BF16): _k_bf16,
    int(T.Q4_0): _k_q4_0,
    int(T.Q4_1): _k_q4_1,
    int(T.Q5_0): _k_q5_0,
    int(T.Q5_1): _k_q5_1,
    int(T.Q8_0): _k_q8_0,
    int(T.Q2_K): _k_q2_k,
    int(T.Q3_K): _k_q3_k,
    int(T.Q4_K): _k_q4_k,
    int(T.Q5_K): _k_q5_k,
    int(T.Q6_K): _k_q6_k,
}

SUPPORTED_TYPES: frozenset[int] = frozenset(T(t) for t in _KERNELS)


# --------------------------------------------------------------------------
# public API


def _sizes(ggml_type: int) -> tuple[int, int]:
    try:
        return GGML_QUANT_SIZES[T(int(ggml_type))]
    except (ValueError, KeyError):
        raise UnsupportedTensorType(f"unsupported GGML tensor type: {type_name(ggml_type)}") from None


def row_bytes(ggml_type: int, n_cols: int) -> int:
    """Bytes used by one row of ``n_cols`` elements of ``ggml_type``.

    Works for every type gguf knows the block size of (also ones
    ``dequantize`` cannot decode), so it can size-check any tensor.
    """
    block_size, type_size = _sizes(ggml_type)
    n_cols = int(n_cols)
    if n_cols < 0 or n_cols % block_size:
        raise ValueError(
            f"row length {n_cols} is not a multiple of the {type_name(ggml_type)} block size {block_size}")
    return n_cols // block_size * type_size


def _kernel(ggml_type: int) -> Callable[[np.ndarray, np.ndarray], None]:
    try:
        return _KERNELS[int(ggml_type)]
    except (KeyError, TypeError, ValueError):
        raise UnsupportedTensorType(f"cannot dequantize GGML tensor type {type_name(ggml_type)}") from None


def _as_bytes(raw) -> np.ndarray:
    if not isinstance(raw, np.ndarray):
        raw = np.frombuffer(raw, dtype=np.uint8)
    raw = np.asarray(raw)  # drops np.memmap subclass without copying
    if raw.dtype != np.uint8 or raw.ndim != 1 or not raw.flags.c_contiguous:
        raw = np.ascontiguousarray(raw).reshape(-1).view(np.uint8)
    return raw


def _decode_blocks(kernel, blocks: np.ndarray, out: np.ndarray) -> None:
    """Run ``kernel`` over (n_blocks, type_size) -> (n_blocks, block_size) in bounded chunks."""
    n_blocks, block_size = out.shape
    step = max(1, _CHUNK_ELEMS // block_size)
    # inf/nan scales give inf/nan outputs exactly as ggml's C code does; numpy
    # would additionally warn about them, which is just noise here.
    with np.errstate(invalid="ignore", over="ignore"):
        for start in range(0, n_blocks, step):
            stop = min(n_blocks, start + step)
            kernel(blocks[start:stop], out[start:stop])


def _check_shape(shape) -> tuple[tuple[int, ...], int, int]:
    shape = tuple(int(s) for s in shape)
    if not shape or any(s < 0 for s in shape):
        raise ValueError(f"bad tensor shape {shape}")
    n_cols = shape[-1]
    n_rows = 1
    for s in shape[:-1]:
        n_rows *= s
    return shape, n_rows, n_cols


def dequantize(raw: np.ndarray, ggml_type: int, shape: tuple[int, ...]) -> np.ndarray:
    """Decode a whole tensor.

    ``raw``: 1-D uint8 array (e.g. a np.memmap slice) holding exactly the
    tensor's bytes.  ``shape``: numpy-order shape whose last dim is ggml's
    ne[0] (the contiguous dim, a multiple of the block size).  Returns a new
    C-contiguous float32 array of ``shape`` that never aliases ``raw``.
    """
    kernel = _kernel(ggml_type)
    shape, n_rows, n_cols = _check_shape(shape)
    rb = row_bytes(ggml_type, n_cols)
    raw = _as_bytes(raw)
    if raw.size != n_rows * rb:
        raise ValueError(
            f"{type_name(ggml_type)} tensor of shape {shape} needs {n_rows * rb} bytes, got {raw.size}")
    block_size, type_size = GGML_QUANT_SIZES[T(int(ggml_type))]
    n_blocks = n_rows * (n_cols // block_size)
    out = np.empty(shape, dtype=np.float32)
    if n_blocks:
        _decode_blocks(kernel, raw.reshape(n_blocks, type_size), out.reshape(n_blocks, block_size))
    return out


def dequantize_rows(raw: np.ndarray, ggml_type: int, shape: tuple[int, ...], rows) -> np.ndarray:
    """Decode only the rows ``rows`` of a tensor stored as for ``dequantize``.

    ``shape`` is the full tensor's 2-D shape (n_rows, n_cols) (more leading
    dims are flattened into rows).  ``rows`` is an integer index array of any
    shape (e.g. token ids (batch, seq)); the result has shape
    ``rows.shape + (n_cols,)``.  Indices must lie in [0, n_rows); negative
    indices are rejected rather than wrapped.
    """
    kernel = _kernel(ggml_type)
    shape, n_rows, n_cols = _check_shape(shape)
    rb = row_bytes(ggml_type, n_cols)
    raw = _as_bytes(raw)
    if raw.size != n_rows * rb:
        raise ValueError(
            f"{type_name(ggml_type)} tensor of shape {shape} needs {n_rows * rb} bytes, got {raw.size}")
    idx = np.asarray(rows)
    if idx.dtype.kind not in "iu":
        if idx.size == 0:
            idx = idx.astype(np.int64)
        else:
            raise TypeError(f"row indices must be integers, got {idx.dtype}")
    if idx.size and (idx.min() < 0 or idx.max() >= n_rows):
        raise IndexError(f"row index out of range [0, {n_rows}): min {idx.min()}, max {idx.max()}")
    block_size, type_size = GGML_QUANT_SIZES[T(int(ggml_type))]
    flat = idx.reshape(-1)
    out = np.empty((flat.size, n_cols), dtype=np.float32)
    if flat.size and n_cols:
        per_row = n_cols // block_size
        table = raw.reshape(n_rows, rb)
        # gather a bounded number of rows at a time so a huge index batch does
        # not make a full quantized copy before decoding
        step = max(1, (_CHUNK_ELEMS * 4) // n_cols)
        for start in range(0, flat.size, step):
            sel = flat[start:start + step]
            packed = table[sel]  # fancy indexing copies just these rows
            _decode_blocks(kernel, packed.reshape(sel.size * per_row, type_size),
                           out[start:start + sel.size].reshape(sel.size * per_row, block_size))
    return out.reshape(idx.shape + (n_cols,))
