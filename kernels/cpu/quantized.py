"""Matrix products that read the GGUF's quantized weights directly (few-row inputs: decode).

A decode step multiplies one row (or a few) by every weight matrix, so it is
bound by the bytes it reads. float32 weights read 4 bytes a weight; here each
matrix is kept as integer codes (1 byte for the 4/5/8-bit block types, 2 for
the k-quants whose sub-block scales multiply into the codes) plus a float32
scale and offset per group of 32 (or 16) inputs, so that

    weight[n, k] == scale[n, k // G] * code[n, k] + offset[n, k // G]

holds *exactly* for the values ggml's dequantization gives (checked when the
weight is prepared). The kernel computes, per output n and input group g,
scale * sum(x * code) + offset * sum(x): the same weights, summed in another
order than OpenBLAS's sgemm.

Codes are stored in tiles of 64 outputs, [n_tiles, K, 64], so one tile is a
contiguous stream and the inner loop runs across 64 outputs in vector
registers (numba, LLVM, AVX2/AVX-512 as the machine has).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from gguf import GGMLQuantizationType as T

from shared.dequant import dequantize

try:  # numba is a dependency; without it every product goes through OpenBLAS
    from numba import njit, prange
except ImportError:  # pragma: no cover - exercised only where numba is missing
    njit = prange = None

TILE = 64

# Forward passes with at most this many rows run their products (here) and their
# decode attention (kernels/cpu/decode_attention.py) on numba's threads; larger
# ones are compute-bound and run on OpenBLAS's sgemm. The two thread pools are
# never interleaved within a pass: on a 2-core machine a switch costs
# milliseconds while the other pool's threads still spin.
COMPILED_MAX_ROWS = 4

# byte offsets of the fp16 block scale ("d") and, where the type has one, the
# fp16 block minimum / min-scale ("m", "dmin") inside one block (ggml-common.h)
_SCALE_FIELDS: dict[int, tuple[int, int | None]] = {
    int(T.Q4_0): (0, None), int(T.Q4_1): (0, 2), int(T.Q5_0): (0, None), int(T.Q5_1): (0, 2),
    int(T.Q8_0): (0, None), int(T.Q2_K): (80, 82), int(T.Q3_K): (108, None),
    int(T.Q4_K): (0, 2), int(T.Q5_K): (0, 2), int(T.Q6_K): (208, None),
}
_ZERO_F16 = np.array([0.0], np.float16).view(np.uint8)


@dataclass(frozen=True)
class QuantizedMatrix:
    """An [out, in] matrix as integer codes with per-group scale and offset, tiled by outputs."""
    codes: np.ndarray      # int8 or int16 [n_tiles, in, TILE]
    scale: np.ndarray      # float32 [n_tiles, in // group, TILE]
    offset: np.ndarray     # float32 [n_tiles, in // group, TILE], or [0, 0, 0] when every offset is 0
    out_features: int
    in_features: int
    group: int

    @property
    def nbytes(self) -> int:
        return self.codes.nbytes + self.scale.nbytes + self.offset.nbytes


def available() -> bool:
    return njit is not None


def _scale_zeroed(blocks: np.ndarray, d_at: int) -> np.ndarray:
    """A copy of the blocks whose fp16 scale "d" is 0: ggml's decoding then gives the offsets alone."""
    b = blocks.copy()
    b[:, d_at:d_at + 2] = _ZERO_F16
    return b.reshape(-1)


def split_codes(raw: np.ndarray, ggml_type: int, shape: tuple[int, int], weight: np.ndarray | None = None
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """(codes int16 [out, in], block scale [out, in // block_size], offset per 16 inputs [out, in // 16]),
    or None for types without integer codes or codes that do not reproduce the weights exactly.

    `weight` is the tensor's float32 decoding when the caller has it. The scale
    is each block's fp16 "d"; the offset the block minimum "m" (Q4_1, Q5_1), or
    for the k-quants ggml's own decoding with "d" set to 0; the codes are
    (weight - offset) / scale, accepted only if fl(scale * code) + offset gives
    back every weight bit for bit.
    """
    fields = _SCALE_FIELDS.get(int(ggml_type))
    if fields is None:
        return None
    from gguf import GGML_QUANT_SIZES
    block_size, type_size = GGML_QUANT_SIZES[T(int(ggml_type))]
    n_out, n_in = shape
    n_blocks = n_in // block_size
    blocks = np.asarray(raw, dtype=np.uint8).reshape(-1, type_size)
    if weight is None:
        weight = dequantize(blocks.reshape(-1), ggml_type, shape)
    d_at, m_at = fields
    scale = _f16(blocks, d_at).reshape(n_out, n_blocks)
    if m_at is None:
        offset = np.zeros((n_out, n_in // 16), np.float32)
    elif block_size == 32:                                   # Q4_1, Q5_1: y = d * q + m
        offset = np.repeat(_f16(blocks, m_at).reshape(n_out, n_blocks), 2, axis=1)
    else:                                                    # k-quants: y = d * (sc * q) - dmin * m_sub
        offset = dequantize(_scale_zeroed(blocks, d_at), ggml_type,
                            shape)[:, ::16].copy()
    codes = np.empty(shape, np.int16)
    if not _encode(np.ascontiguousarray(weight, dtype=np.float32), scale, offset, block_size, codes):
        return None
    return codes, scale, offset


def _f16(blocks: np.ndarray, at: int) -> np.ndarray:
    return blocks[:, at:at + 2].copy().view(np.float16).astype(np.float32).reshape(-1)


def _encode_rows(weight, scale, offset16, block_size, codes):  # pragma: no cover - compiled by numba
    """codes = rint((w - offset) / scale); False unless fl(scale * code) + offset == w everywhere."""
    n_rows, n_in = weight.shape
    ok = np.ones(n_rows, np.bool_)
    for i in prange(n_rows):
        for k in range(n_in):
            d = scale[i, k // block_size]
            off = offset16[i, k // 16]
            w = weight[i, k]
            c = np.float32(0.0)
            if d != 0:
                c = np.float32(np.rint((w - off) / d))
            if not (c >= -32768.0 and c <= 32767.0):
                ok[i] = False
                break
            back = np.float32(d * c)
            if off != 0:
                back = np.float32(back + off)
            if back != w:
                ok[i] = False
                break
            codes[i, k] = np.int16(c)
    return ok.all()


_encode = njit(parallel=True, cache=True)(_encode_rows) if njit is not None else None


_CHUNK_ROWS = 8192


def quantize_parts(parts: list[tuple[np.ndarray, int, tuple[int, int]]], dense: np.ndarray | None = None
                   ) -> QuantizedMatrix | None:
    """One QuantizedMatrix from [out, in] GGUF tensors stacked along `out`, or None when a part's
    type has no integer codes (F32/F16/BF16) or the codes do not reproduce ggml's values exactly.
    `dense`, when given, is the stacked float32 decoding of the parts (saves decoding them again)."""
    if not available():
        return None
    from gguf import GGML_QUANT_SIZES
    n_in = parts[0][2][1]
    if n_in % 16:
        return None
    codes_out, scale_out, offset_out = [], [], []
    first_row = 0
    for raw, ggml_type, (n_out, part_in) in parts:
        if int(ggml_type) not in _SCALE_FIELDS or part_in != n_in:
            return None
        block_size, type_size = GGML_QUANT_SIZES[T(int(ggml_type))]
        row_bytes = n_in // block_size * type_size
        raw = np.asarray(raw, dtype=np.uint8).reshape(n_out, row_bytes)
        for r0 in range(0, n_out, _CHUNK_ROWS):
            rows = raw[r0:r0 + _CHUNK_ROWS]
            shape = (rows.shape[0], n_in)
            weight = dense[first_row + r0:first_row + r0 + shape[0]] if dense is not None else None
            split = split_codes(rows.reshape(-1), ggml_type, shape, weight)
            if split is None:
                return None
            codes, scale, offset = split
            lo, hi = codes.min(initial=0), codes.max(initial=0)
            codes_out.append(codes.astype(np.int8) if -128 <= lo and hi <= 127 else codes)
            scale_out.append(np.repeat(scale, block_size // 16, axis=1))
            offset_out.append(offset)
        first_row += n_out
    scale16 = np.concatenate(scale_out)
    offset16 = np.concatenate(offset_out)
    group = 32 if (_constant_in_groups(scale16, 2) and _constant_in_groups(offset16, 2)) else 16
    step = group // 16
    scale_g, offset_g = scale16[:, ::step], offset16[:, ::step]
    dtype = np.int8 if all(c.dtype == np.int8 for c in codes_out) else np.int16
    return QuantizedMatrix(
        codes=_tile(codes_out, dtype), scale=_tile([scale_g], np.float32),
        offset=_tile([offset_g], np.float32) if np.any(offset_g) else np.zeros((0, 0, 0), np.float32),
        out_features=scale16.shape[0], in_features=n_in, group=group)


def _constant_in_groups(a: np.ndarray, group: int) -> bool:
    g = a.reshape(a.shape[0], -1, group)
    return bool(np.array_equal(g, np.broadcast_to(g[:, :, :1], g.shape)))


def _tile(row_chunks: list[np.ndarray], dtype) -> np.ndarray:
    """[out, k] (given as chunks of rows) -> [ceil(out / TILE), k, TILE], zero-padded."""
    n_out, k = sum(c.shape[0] for c in row_chunks), row_chunks[0].shape[1]
    n_tiles = -(-n_out // TILE)
    tiles = np.zeros((n_tiles, k, TILE), dtype)
    row = 0
    for chunk in row_chunks:
        for r0 in range(0, chunk.shape[0], TILE):       # one tile's rows at a time: no full-size temporary
            part = chunk[r0:r0 + TILE]
            t, j = divmod(row, TILE)
            while part.shape[0]:
                take = min(TILE - j, part.shape[0])
                tiles[t, :, j:j + take] = part[:take].T
                part, row = part[take:], row + take
                t, j = divmod(row, TILE)
    return tiles


def matmul(x: np.ndarray, w: QuantizedMatrix) -> np.ndarray:
    """x float32 [m, in] times the matrix -> float32 [m, out]."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    m = x.shape[0]
    out = np.empty((m, w.codes.shape[0] * TILE), np.float32)
    if w.offset.size:
        group_sums = x.reshape(m, -1, w.group).sum(axis=2, dtype=np.float32)
    else:
        group_sums = np.zeros((m, 0), np.float32)
    _kernel(x, w.codes, w.scale, w.offset, group_sums, out)
    return out[:, :w.out_features] if out.shape[1] != w.out_features else out


def _qmatmul(x, codes, scale, offset, group_sums, out):  # pragma: no cover - compiled by numba
    m_rows, k_in = x.shape
    n_tiles = codes.shape[0]
    n_groups = scale.shape[1]
    group = k_in // n_groups
    has_offset = offset.shape[0] > 0
    for t in prange(n_tiles):
        c = codes[t]
        sc = scale[t]
        acc = np.empty(TILE, np.float32)
        part = np.empty(TILE, np.float32)
        for m in range(m_rows):
            for j in range(TILE):
                acc[j] = 0.0
            for g in range(n_groups):
                for j in range(TILE):
                    part[j] = 0.0
                for kk in range(group):
                    k = g * group + kk
                    xv = x[m, k]
                    for j in range(TILE):
                        part[j] += xv * np.float32(c[k, j])
                for j in range(TILE):
                    acc[j] += sc[g, j] * part[j]
                if has_offset:
                    xs = group_sums[m, g]
                    for j in range(TILE):
                        acc[j] += xs * offset[t, g, j]
            for j in range(TILE):
                out[m, t * TILE + j] = acc[j]


_kernel = njit(parallel=True, fastmath=True, cache=True, nogil=True)(_qmatmul) if available() else None


def warm_up() -> None:
    """Compile (or load from numba's cache) the kernel for both code widths and the load-time split."""
    if not available():
        return
    x = np.ones((1, 32), np.float32)
    for dtype in (np.int8, np.int16):
        m = QuantizedMatrix(np.ones((1, 32, TILE), dtype), np.ones((1, 1, TILE), np.float32),
                            np.ones((1, 1, TILE), np.float32), TILE, 32, 32)
        matmul(x, m)
    raw = np.zeros(34, np.uint8)                    # one Q8_0 block: compiles the load-time split too
    split_codes(raw, int(T.Q8_0), (1, 32))
