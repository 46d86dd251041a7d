"""Weights for the 8-bit products (kernels/cpu/int8_matmul.py): GGUF codes laid out as the
kernel reads them.

Each matrix keeps its GGUF codes, biased to unsigned bytes when signed: the block's code with its
d (and minimum m) for the 32-weight types, each sub-block's code with d * sc (and -dmin * m) for
Q4_K/Q5_K, groups of 16 for Q6_K; fl(scale * code) + offset must give back ggml's weight bit for
bit, or the matrix is not taken. Codes are tiled by 32 outputs as [group, step, 32 outputs, 4
inputs], so that one 64-byte load feeds 16 outputs.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T
from gguf import quants as gguf_quants

from kernels.cpu import quantized
from shared.dequant import dequantize

TILE = 32           # outputs per tile: two 16-lane vectors
BYTE_CODE_TYPES = frozenset(int(t) for t in (T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K))


@dataclass(frozen=True)
class Int8Matrix:
    """An [out, in] matrix as unsigned byte codes with per-group scale and offset, tiled by outputs."""
    codes: np.ndarray      # uint8 [n_tiles, groups, group // 4, TILE, 4], flattened
    scale: np.ndarray      # float32 [n_tiles, groups, TILE], flattened
    offset: np.ndarray     # float32 [n_tiles, groups, TILE], flattened; empty when every offset is 0
    bias: int              # what was added to the codes to store them unsigned (VNNI: 128 if signed)
    out_features: int
    in_features: int
    group: int
    run: int = 0           # AVX2: steps of 4 inputs summed in 16 bits before widening; 0: signed codes

    @property
    def n_tiles(self) -> int:
        return -(-self.out_features // TILE)

    @property
    def nbytes(self) -> int:
        return self.codes.nbytes + self.scale.nbytes + self.offset.nbytes


def from_parts(parts: list[tuple[np.ndarray, int, tuple[int, int]]], dense: np.ndarray | None = None,
               vnni: bool = True) -> Int8Matrix | None:
    """One matrix for the kernel from [out, in] GGUF tensors stacked along `out` (`dense`: their
    stacked float32 decoding, when the caller has it), laid out for VNNI's `vpdpbusd` or (vnni
    False) AVX2's `vpmaddubsw`; None when a part's type has no byte codes or its codes do not give
    back ggml's weights bit for bit."""
    n_in = parts[0][2][1]
    codes, scales, offsets, groups = [], [], [], []
    first_row = 0
    for raw, ggml_type, (n_out, part_in) in parts:
        if part_in != n_in or n_in % 32:
            return None
        raw = np.asarray(raw, dtype=np.uint8).reshape(n_out, -1)
        for r0 in range(0, n_out, _CHUNK_ROWS):
            rows = raw[r0:r0 + _CHUNK_ROWS]
            weight = dense[first_row + r0:first_row + r0 + rows.shape[0]] if dense is not None else None
            split = _byte_split(rows.reshape(-1), int(ggml_type), (rows.shape[0], n_in), weight)
            if split is None:
                return None
            for out, value in zip((codes, scales, offsets, groups), split):
                out.append(value)
        first_row += n_out
    group = min(groups)             # 16 when a part has sub-blocks of 16 (Q6_K): the others repeat theirs
    scale = np.concatenate([np.repeat(s, g // group, axis=1) for s, g in zip(scales, groups)])
    offset = np.concatenate([np.repeat(o, g // group, axis=1) for o, g in zip(offsets, groups)])
    lo = min(int(c.min(initial=0)) for c in codes)
    hi = max(int(c.max(initial=0)) for c in codes)
    if vnni:
        (bias, run), stored = (128 if lo < 0 else 0, 0), (0, 255)
    else:
        bias, run = avx2_layout(lo, hi)
        stored = (0, 129) if run else (-128, 127)      # signed codes: their bytes, for the sign trick
    if lo + bias < stored[0] or hi + bias > stored[1]:
        return None
    n_out = scale.shape[0]
    n_tiles = -(-n_out // TILE)
    padded = np.zeros((n_tiles * TILE, n_in), np.uint8)
    row = 0
    for c in codes:
        padded[row:row + c.shape[0]] = (c + bias) & 0xFF        # int16 codes: AVX2's negative ones as bytes
        row += c.shape[0]
    # [tile, out, group, step, 4] -> [tile, group, step, out, 4]: one 64-byte load feeds 16 outputs
    tiled = padded.reshape(n_tiles, TILE, n_in // group, group // 4, 4).transpose(0, 2, 3, 1, 4)
    return Int8Matrix(np.ascontiguousarray(tiled).reshape(-1), _tile_groups(scale, n_tiles),
                      _tile_groups(offset, n_tiles) if np.any(offset) else np.zeros(0, np.float32),
                      bias, n_out, n_in, group, run)


def avx2_layout(lo: int, hi: int) -> tuple[int, int]:
    """(bias, run) for codes in [lo, hi] on AVX2. vpmaddubsw multiplies unsigned bytes by signed ones
    and saturates each pair's sum at 16 bits: codes spanning at most 129 values are stored unsigned
    (code - lo), so 2 * 129 * 127 < 2**15 and no sign trick is needed, and a run of steps whose pair
    sums still fit in 16 bits is added with vpaddw before one vpmaddwd widens it (4-bit codes: 8
    steps, a whole group of 32). Wider codes (Q8_0's 256 values) stay signed: run 0."""
    bias = max(0, -lo)
    largest = hi + bias
    if largest > 129:
        return 0, 0
    run = 8
    while run > 1 and run * 2 * largest * 127 > 2 ** 15 - 1:
        run //= 2
    return bias, run


_CHUNK_ROWS = 8192


def _tile_groups(a: np.ndarray, n_tiles: int) -> np.ndarray:
    """[out, groups] -> [tile, groups, TILE] flattened, zero-padded."""
    padded = np.zeros((n_tiles * TILE, a.shape[1]), np.float32)
    padded[:a.shape[0]] = a
    return np.ascontiguousarray(padded.reshape(n_tiles, TILE, -1).transpose(0, 2, 1)).reshape(-1)


def _byte_split(raw: np.ndarray, ggml_type: int, shape: tuple[int, int], weight: np.ndarray | None
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray, int] | None:
    """(codes int16 [out, in], scale and offset float32 [out, in // group], group) such that
    fl(scale * code) + offset is ggml's weight exactly: the block's d (and minimum m) for the 32-weight
    types, and for the k-quants each sub-block's d * sc (and -dmin * m), as ggml decodes them."""
    if ggml_type in (T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0):
        split = quantized.split_codes(raw, ggml_type, shape, weight)
        return None if split is None else (split[0], split[1], split[2][:, ::2].copy(), 32)
    n_out, n_in = shape
    blocks = raw.reshape(-1, GGML_QUANT_SIZES[T(ggml_type)][1])
    if ggml_type in (T.Q4_K, T.Q5_K):                  # y = (d * sc) * q - dmin * m, sub-blocks of 32
        sc, m = gguf_quants.Q4_K.get_scale_min(blocks[:, 4:16])
        scale = quantized._f16(blocks, 0)[:, None] * sc.astype(np.float32)
        offset = -(quantized._f16(blocks, 2)[:, None] * m.astype(np.float32))
        group = 32
    elif ggml_type == T.Q6_K:                          # y = (d * sc) * (q - 32), sub-blocks of 16
        scale = quantized._f16(blocks, 208)[:, None] * blocks[:, 192:208].view(np.int8).astype(np.float32)
        offset = np.zeros_like(scale)
        group = 16
    else:
        return None
    scale, offset = scale.reshape(n_out, -1), offset.reshape(n_out, -1)
    if weight is None:
        weight = dequantize(raw, ggml_type, shape)
    codes = np.empty(shape, np.int16)
    if not quantized._encode(np.ascontiguousarray(weight, dtype=np.float32), scale,
                             np.repeat(offset, group // 16, axis=1), group, codes):
        return None
    return codes, scale, offset, group
