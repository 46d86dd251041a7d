"""Tests for shared/dequant.py.

The reference decoders below are straight per-block transcriptions of ggml's
scalar C code (``dequantize_row_*`` in ggml/src/ggml-quants.c), using
np.float32 scalar arithmetic in the same order as the C code, so the
vectorized implementation (and gguf-py's ``gguf.quants``) must match them
bit for bit.
"""

from __future__ import annotations

import struct
import sys
import time
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import gguf  # noqa: E402
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T  # noqa: E402

from shared import dequant as dq  # noqa: E402
from shared.dequant import (  # noqa: E402
    SUPPORTED_TYPES,
    UnsupportedTensorType,
    dequantize,
    dequantize_rows,
    row_bytes,
)

F = np.float32
QK_K = 256


# ---------------------------------------------------------------------------
# reference decoders (per block, transcribed from ggml-quants.c)


def _f16(blk: bytes, off: int) -> np.float32:
    return F(np.frombuffer(blk[off:off + 2], dtype="<f2")[0])


def ref_q4_0(raw: bytes, k: int) -> np.ndarray:
    qk = 32
    y = np.empty(k, np.float32)
    for i in range(k // qk):
        blk = raw[i * 18:(i + 1) * 18]
        d = _f16(blk, 0)
        qs = blk[2:18]
        for j in range(qk // 2):
            x0 = (qs[j] & 0x0F) - 8
            x1 = (qs[j] >> 4) - 8
            y[i * qk + j] = F(x0) * d
            y[i * qk + j + qk // 2] = F(x1) * d
    return y


def ref_q4_1(raw: bytes, k: int) -> np.ndarray:
    qk = 32
    y = np.empty(k, np.float32)
    for i in range(k // qk):
        blk = raw[i * 20:(i + 1) * 20]
        d = _f16(blk, 0)
        m = _f16(blk, 2)
        qs = blk[4:20]
        for j in range(qk // 2):
            x0 = qs[j] & 0x0F
            x1 = qs[j] >> 4
            y[i * qk + j] = F(x0) * d + m
            y[i * qk + j + qk // 2] = F(x1) * d + m
    return y


def ref_q5_0(raw: bytes, k: int) -> np.ndarray:
    qk = 32
    y = np.empty(k, np.float32)
    for i in range(k // qk):
        blk = raw[i * 22:(i + 1) * 22]
        d = _f16(blk, 0)
        qh = int.from_bytes(blk[2:6], "little")
        qs = blk[6:22]
        for j in range(qk // 2):
            xh_0 = ((qh >> (j + 0)) << 4) & 0x10
            xh_1 = (qh >> (j + 12)) & 0x10
            x0 = ((qs[j] & 0x0F) | xh_0) - 16
            x1 = ((qs[j] >> 4) | xh_1) - 16
            y[i * qk + j] = F(x0) * d
            y[i * qk + j + qk // 2] = F(x1) * d
    return y


def ref_q5_1(raw: bytes, k: int) -> np.ndarray:
    qk = 32
    y = np.empty(k, np.float32)
    for i in range(k // qk):
        blk = raw[i * 24:(i + 1) * 24]
        d = _f16(blk, 0)
        m = _f16(blk, 2)
        qh = int.from_bytes(blk[4:8], "little")
        qs = blk[8:24]
        for j in range(qk // 2):
            xh_0 = ((qh >> (j + 0)) << 4) & 0x10
            xh_1 = (qh >> (j + 12)) & 0x10
            x0 = (qs[j] & 0x0F) | xh_0
            x1 = (qs[j] >> 4) | xh_1
            y[i * qk + j] = F(x0) * d + m
            y[i * qk + j + qk // 2] = F(x1) * d + m
    return y


def ref_q8_0(raw: bytes, k: int) -> np.ndarray:
    qk = 32
    y = np.empty(k, np.float32)
    for i in range(k // qk):
        blk = raw[i * 34:(i + 1) * 34]
        d = _f16(blk, 0)
        qs = np.frombuffer(blk[2:34], dtype=np.int8)
        for j in range(qk):
            y[i * qk + j] = F(int(qs[j])) * d
    return y


def ref_q2_K(raw: bytes, k: int) -> np.ndarray:
    # block_q2_K { uint8 scales[16]; uint8 qs[64]; fp16 d; fp16 dmin; }
    y = np.empty(k, np.float32)
    p = 0
    for i in range(k // QK_K):
        blk = raw[i * 84:(i + 1) * 84]
        scales = blk[0:16]
        d = _f16(blk, 80)
        mn = _f16(blk, 82)
        q = 16  # offset of qs inside blk
        is_ = 0
        for _n in range(0, QK_K, 128):
            shift = 0
            for _j in range(4):
                sc = scales[is_]
                is_ += 1
                dl = d * F(sc & 0xF)
                ml = mn * F(sc >> 4)
                for l in range(16):
                    y[p] = dl * F((blk[q + l] >> shift) & 3) - ml
                    p += 1
                sc = scales[is_]
                is_ += 1
                dl = d * F(sc & 0xF)
                ml = mn * F(sc >> 4)
                for l in range(16):
                    y[p] = dl * F((blk[q + l + 16] >> shift) & 3) - ml
                    p += 1
                shift += 2
            q += 32
    return y


def ref_q3_K(raw: bytes, k: int) -> np.ndarray:
    # block_q3_K { uint8 hmask[32]; uint8 qs[64]; uint8 scales[12]; fp16 d; }
    kmask1 = 0x03030303
    kmask2 = 0x0F0F0F0F
    y = np.empty(k, np.float32)
    p = 0
    for i in range(k // QK_K):
        blk = raw[i * 110:(i + 1) * 110]
        d_all = _f16(blk, 108)
        hm = blk[0:32]
        aux = list(struct.unpack("<3I", blk[96:108])) + [0]
        tmp = aux[2]
        aux[2] = ((aux[0] >> 4) & kmask2) | (((tmp >> 4) & kmask1) << 4)
        aux[3] = ((aux[1] >> 4) & kmask2) | (((tmp >> 6) & kmask1) << 4)
        aux[0] = (aux[0] & kmask2) | (((tmp >> 0) & kmask1) << 4)
        aux[1] = (aux[1] & kmask2) | (((tmp >> 2) & kmask1) << 4)
        scales = np.frombuffer(struct.pack("<4I", *aux), dtype=np.int8)
        q = 32  # offset of qs inside blk
        m = 1
        is_ = 0
        for _n in range(0, QK_K, 128):
            shift = 0
            for _j in range(4):
                dl = d_all * F(int(scales[is_]) - 32)
                is_ += 1
                for l in range(16):
                    v = ((blk[q + l] >> shift) & 3) - (0 if (hm[l] & m) else 4)
                    y[p] = dl * F(v)
                    p += 1
                dl = d_all * F(int(scales[is_]) - 32)
                is_ += 1
                for l in range(16):
                    v = ((blk[q + l + 16] >> shift) & 3) - (0 if (hm[l + 16] & m) else 4)
                    y[p] = dl * F(v)
                    p += 1
                shift += 2
                m <<= 1
            q += 32
    return y


def _get_scale_min_k4(j: int, q: bytes) -> tuple[int, int]:
    if j < 4:
        return q[j] & 63, q[j + 4] & 63
    return (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4), (q[j + 4] >> 4) | ((q[j - 0] >> 6) << 4)


def ref_q4_K(raw: bytes, k: int) -> np.ndarray:
    # block_q4_K { fp16 d; fp16 dmin; uint8 scales[12]; uint8 qs[128]; }
    y = np.empty(k, np.float32)
    p = 0
    for i in range(k // QK_K):
        blk = raw[i * 144:(i + 1) * 144]
        d = _f16(blk, 0)
        mn = _f16(blk, 2)
        scales = blk[4:16]
        q = 16
        is_ = 0
        for _j in range(0, QK_K, 64):
            sc, m = _get_scale_min_k4(is_ + 0, scales)
            d1, m1 = d * F(sc), mn * F(m)
            sc, m = _get_scale_min_k4(is_ + 1, scales)
            d2, m2 = d * F(sc), mn * F(m)
            for l in range(32):
                y[p] = d1 * F(blk[q + l] & 0xF) - m1
                p += 1
            for l in range(32):
                y[p] = d2 * F(blk[q + l] >> 4) - m2
                p += 1
            q += 32
            is_ += 2
    return y


def ref_q5_K(raw: bytes, k: int) -> np.ndarray:
    # block_q5_K { fp16 d; fp16 dmin; uint8 scales[12]; uint8 qh[32]; uint8 qs[128]; }
    y = np.empty(k, np.float32)
    p = 0
    for i in range(k // QK_K):
        blk = raw[i * 176:(i + 1) * 176]
        d = _f16(blk, 0)
        mn = _f16(blk, 2)
        scales = blk[4:16]
        qh = blk[16:48]
        ql = 48
        is_ = 0
        u1, u2 = 1, 2
        for _j in range(0, QK_K, 64):
            sc, m = _get_scale_min_k4(is_ + 0, scales)
            d1, m1 = d * F(sc), mn * F(m)
            sc, m = _get_scale_min_k4(is_ + 1, scales)
            d2, m2 = d * F(sc), mn * F(m)
            for l in range(32):
                y[p] = d1 * F((blk[ql + l] & 0xF) + (16 if qh[l] & u1 else 0)) - m1
                p += 1
            for l in range(32):
                y[p] = d2 * F((blk[ql + l] >> 4) + (16 if qh[l] & u2 else 0)) - m2
                p += 1
            ql += 32
            is_ += 2
            u1 <<= 2
            u2 <<= 2
    return y


def ref_q6_K(raw: bytes, k: int) -> np.ndarray:
    # block_q6_K { uint8 ql[128]; uint8 qh[64]; int8 scales[16]; fp16 d; }
    y = np.empty(k, np.float32)
    for i in range(k // QK_K):
        blk = raw[i * 210:(i + 1) * 210]
        d = _f16(blk, 208)
        yb = i * QK_K
        ql, qh, sc = 0, 128, 0
        scales = [int(v) for v in np.frombuffer(blk[192:208], dtype=np.int8)]
        for _n in range(0, QK_K, 128):
            for l in range(32):
                is_ = l // 16
                q1 = ((blk[ql + l + 0] & 0xF) | (((blk[qh + l] >> 0) & 3) << 4)) - 32
                q2 = ((blk[ql + l + 32] & 0xF) | (((blk[qh + l] >> 2) & 3) << 4)) - 32
                q3 = ((blk[ql + l + 0] >> 4) | (((blk[qh + l] >> 4) & 3) << 4)) - 32
                q4 = ((blk[ql + l + 32] >> 4) | (((blk[qh + l] >> 6) & 3) << 4)) - 32
                y[yb + l + 0] = d * F(scales[sc + is_ + 0]) * F(q1)
                y[yb + l + 32] = d * F(scales[sc + is_ + 2]) * F(q2)
                y[yb + l + 64] = d * F(scales[sc + is_ + 4]) * F(q3)
                y[yb + l + 96] = d * F(scales[sc + is_ + 6]) * F(q4)
            yb += 128
            ql += 64
            qh += 32
            sc += 8
    return y


# name -> (reference decoder, byte offsets of the fp16 fields in a block)
QUANT_TYPES = {
    "Q4_0": (ref_q4_0, [0]),
    "Q4_1": (ref_q4_1, [0, 2]),
    "Q5_0": (ref_q5_0, [0]),
    "Q5_1": (ref_q5_1, [0, 2]),
    "Q8_0": (ref_q8_0, [0]),
    "Q2_K": (ref_q2_K, [80, 82]),
    "Q3_K": (ref_q3_K, [108]),
    "Q4_K": (ref_q4_K, [0, 2]),
    "Q5_K": (ref_q5_K, [0, 2]),
    "Q6_K": (ref_q6_K, [208]),
}
ALL_TYPES = ["F32", "F16", "BF16", *QUANT_TYPES]


def random_tensor(name: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Random bytes of a (rows, cols) tensor: random quants, finite fp16 scales in [-2, 2]."""
    t = T[name]
    block_size, type_size = GGML_QUANT_SIZES[t]
    n = rows * cols
    if name == "F32":
        return rng.standard_normal(n).astype(np.float32).view(np.uint8)
    if name == "F16":
        return rng.standard_normal(n).astype(np.float16).view(np.uint8)
    if name == "BF16":
        return (rng.standard_normal(n).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
    nb = n // block_size
    blocks = rng.integers(0, 256, size=(nb, type_size), dtype=np.uint8)
    for off in QUANT_TYPES[name][1]:
        blocks[:, off:off + 2] = rng.uniform(-2, 2, size=(nb, 1)).astype(np.float16).view(np.uint8)
    return blocks.reshape(-1)


def reference(name: str, raw: np.ndarray, rows: int, cols: int) -> np.ndarray:
    return QUANT_TYPES[name][0](raw.tobytes(), rows * cols).reshape(rows, cols)


def assert_bits_equal(a: np.ndarray, b: np.ndarray) -> None:
    assert a.shape == b.shape and a.dtype == b.dtype == np.float32
    if not np.array_equal(a.view(np.uint32), b.view(np.uint32)):
        bad = np.flatnonzero(a.view(np.uint32).ravel() != b.view(np.uint32).ravel())
        raise AssertionError(
            f"{bad.size} mismatches, first at flat index {bad[0]}: {a.ravel()[bad[0]]!r} != {b.ravel()[bad[0]]!r}")


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(12345)


# ---------------------------------------------------------------------------
# correctness against the C reference


@pytest.mark.parametrize("name", list(QUANT_TYPES))
def test_quant_types_match_ggml_reference(name, rng):
    rows, cols = 3, 512
    raw = random_tensor(name, rows, cols, rng)
    out = dequantize(raw, T[name], (rows, cols))
    assert out.dtype == np.float32 and out.shape == (rows, cols) and out.flags.c_contiguous
    assert np.isfinite(out).all()
    assert_bits_equal(out, reference(name, raw, rows, cols))


@pytest.mark.parametrize("name", list(QUANT_TYPES))
def test_gguf_py_dequantize_also_matches_reference(name, rng):
    # documents that gguf.quants agrees with ggml for these types (we use our
    # own kernels for speed and memory, not correctness)
    rows, cols = 2, 512
    raw = random_tensor(name, rows, cols, rng)
    got = np.asarray(gguf.quants.dequantize(raw.reshape(rows, -1), T[name]), dtype=np.float32)
    assert_bits_equal(got.reshape(rows, cols), reference(name, raw, rows, cols))


@pytest.mark.parametrize("name", list(QUANT_TYPES))
def test_extreme_quant_bytes(name, rng):
    # all-0x00 and all-0xFF quant bytes hit the ends of every bit field
    rows, cols = 2, 256
    for fill in (0x00, 0xFF, 0x55, 0xAA):
        raw = random_tensor(name, rows, cols, rng)
        blocks = raw.reshape(-1, GGML_QUANT_SIZES[T[name]][1])
        keep = np.zeros(blocks.shape[1], dtype=bool)
        for off in QUANT_TYPES[name][1]:
            keep[off:off + 2] = True
        blocks[:, ~keep] = fill
        assert_bits_equal(dequantize(raw, T[name], (rows, cols)), reference(name, raw, rows, cols))


def test_f16_matches_numpy(rng):
    vals = np.concatenate([
        rng.standard_normal(4 * 64).astype(np.float16),
        np.array([0.0, -0.0, np.inf, -np.inf, 65504, -65504, 6e-8, -6e-8], dtype=np.float16),
        np.full(8, 1e-5, dtype=np.float16),  # subnormal
    ]).reshape(4, 68)
    out = dequantize(vals.view(np.uint8).reshape(-1), T.F16, vals.shape)
    assert_bits_equal(out, vals.astype(np.float32))


def test_bf16_matches_float32_truncation(rng):
    f = np.concatenate([
        rng.standard_normal(3 * 60).astype(np.float32) * 100,
        np.array([0.0, -0.0, np.inf, -np.inf, 1e-40, -3.4e38, 1.0, -2.5] * 2, dtype=np.float32),
        np.full(4, np.nan, dtype=np.float32),
    ]).reshape(4, 50)
    bf16 = (f.view(np.uint32) >> 16).astype(np.uint16)
    out = dequantize(bf16.view(np.uint8).reshape(-1), T.BF16, f.shape)
    expected = (f.view(np.uint32) & np.uint32(0xFFFF0000)).view(np.float32)
    assert_bits_equal(out, expected)
    assert out[0, 0] == pytest.approx(f[0, 0], rel=1 / 128)


def test_f32_is_a_copy(rng):
    vals = rng.standard_normal((7, 9)).astype(np.float32)
    raw = vals.view(np.uint8).reshape(-1)
    out = dequantize(raw, T.F32, (7, 9))
    assert_bits_equal(out, vals)
    assert not np.shares_memory(out, raw)


@pytest.mark.parametrize("name", ALL_TYPES)
def test_chunked_decoding_matches_single_pass(name, rng, monkeypatch):
    rows, cols = 5, 512
    raw = random_tensor(name, rows, cols, rng)
    whole = dequantize(raw, T[name], (rows, cols))
    monkeypatch.setattr(dq, "_CHUNK_ELEMS", 300)  # many chunks, not aligned to rows
    assert_bits_equal(dequantize(raw, T[name], (rows, cols)), whole)


@pytest.mark.parametrize("name", ["F32", "F16", "BF16", "Q8_0", "Q5_0", "Q4_K", "Q6_K"])
def test_memmap_input_at_odd_offset(name, rng, tmp_path):
    rows, cols = 4, 256
    raw = random_tensor(name, rows, cols, rng)
    path = tmp_path / "t.bin"
    path.write_bytes(b"\x07" * 3 + raw.tobytes() + b"\x09" * 5)
    mm = np.memmap(path, dtype=np.uint8, mode="r")
    view = mm[3:3 + raw.size]
    out = dequantize(view, T[name], (rows, cols))
    assert type(out) is np.ndarray and out.flags.c_contiguous and out.flags.writeable
    assert_bits_equal(out, dequantize(raw, T[name], (rows, cols)))
    del view, mm


def test_other_shapes(rng):
    raw = random_tensor("Q4_K", 6, 256, rng)
    flat = dequantize(raw, T.Q4_K, (6, 256))
    assert_bits_equal(dequantize(raw, T.Q4_K, (6 * 256,)), flat.reshape(-1))
    assert_bits_equal(dequantize(raw, T.Q4_K, (2, 3, 256)), flat.reshape(2, 3, 256))
    assert dequantize(np.zeros(0, np.uint8), T.Q8_0, (0, 64)).shape == (0, 64)
    # bytes-like input is accepted too
    assert_bits_equal(dequantize(raw.tobytes(), T.Q4_K, (6, 256)), flat)


# ---------------------------------------------------------------------------
# API details and errors


def test_supported_types():
    expected = {T[n] for n in ALL_TYPES}
    assert SUPPORTED_TYPES == expected
    assert isinstance(SUPPORTED_TYPES, frozenset)
    assert all(int(t) in SUPPORTED_TYPES for t in expected)


@pytest.mark.parametrize("ggml_type", [T.IQ2_XXS, T.Q8_1, T.IQ4_NL, 999])
def test_unsupported_type_raises(ggml_type):
    with pytest.raises(UnsupportedTensorType) as ei:
        dequantize(np.zeros(1024, np.uint8), ggml_type, (1, 256))
    assert isinstance(ei.value, ValueError)
    name = ggml_type.name if isinstance(ggml_type, T) else str(ggml_type)
    assert name in str(ei.value)
    with pytest.raises(UnsupportedTensorType):
        dequantize_rows(np.zeros(1024, np.uint8), ggml_type, (1, 256), np.array([0]))


def test_bad_sizes_raise(rng):
    raw = random_tensor("Q4_0", 2, 64, rng)
    with pytest.raises(ValueError, match="bytes"):
        dequantize(raw[:-1], T.Q4_0, (2, 64))
    with pytest.raises(ValueError, match="multiple"):
        dequantize(raw, T.Q4_0, (4, 36))
    with pytest.raises(ValueError):
        row_bytes(T.Q6_K, 100)


def test_row_bytes():
    assert row_bytes(T.F32, 640) == 2560
    assert row_bytes(T.F16, 640) == 1280
    assert row_bytes(T.BF16, 640) == 1280
    assert row_bytes(T.Q8_0, 640) == 20 * 34
    assert row_bytes(T.Q4_0, 2048) == 64 * 18
    assert row_bytes(T.Q4_K, 2048) == 8 * 144
    assert row_bytes(T.Q6_K, 2048) == 8 * 210
    assert row_bytes(int(T.Q5_0), 640) == 20 * 22
    # size checks also work for types we cannot decode
    assert row_bytes(T.IQ4_XS, 256) == GGML_QUANT_SIZES[T.IQ4_XS][1]
    with pytest.raises(UnsupportedTensorType):
        row_bytes(999, 256)


# ---------------------------------------------------------------------------
# dequantize_rows


@pytest.mark.parametrize("name", ALL_TYPES)
def test_dequantize_rows_matches_full(name, rng):
    rows, cols = 40, 256
    raw = random_tensor(name, rows, cols, rng)
    full = dequantize(raw, T[name], (rows, cols))
    idx = np.array([[3, 0, 39], [3, 17, 3]], dtype=np.int64)
    got = dequantize_rows(raw, T[name], (rows, cols), idx)
    assert got.shape == (2, 3, cols) and got.dtype == np.float32 and got.flags.c_contiguous
    assert_bits_equal(got, full[idx])
    one = dequantize_rows(raw, T[name], (rows, cols), [7])
    assert_bits_equal(one, full[[7]])
    scalar = dequantize_rows(raw, T[name], (rows, cols), np.int32(5))
    assert_bits_equal(scalar, full[5])


def test_dequantize_rows_chunks_and_errors(rng, monkeypatch):
    rows, cols = 64, 512
    raw = random_tensor("Q8_0", rows, cols, rng)
    full = dequantize(raw, T.Q8_0, (rows, cols))
    idx = rng.integers(0, rows, size=200).astype(np.uint32)
    monkeypatch.setattr(dq, "_CHUNK_ELEMS", 700)  # several gather batches
    assert_bits_equal(dequantize_rows(raw, T.Q8_0, (rows, cols), idx), full[idx])
    assert dequantize_rows(raw, T.Q8_0, (rows, cols), np.array([], dtype=np.int64)).shape == (0, cols)
    assert dequantize_rows(raw, T.Q8_0, (rows, cols), []).shape == (0, cols)
    with pytest.raises(IndexError):
        dequantize_rows(raw, T.Q8_0, (rows, cols), [rows])
    with pytest.raises(IndexError):
        dequantize_rows(raw, T.Q8_0, (rows, cols), [-1])
    with pytest.raises(TypeError):
        dequantize_rows(raw, T.Q8_0, (rows, cols), [1.5])
    with pytest.raises(ValueError):
        dequantize_rows(raw[:-1], T.Q8_0, (rows, cols), [0])


def test_dequantize_rows_from_memmap(rng, tmp_path):
    rows, cols = 300, 640
    raw = random_tensor("Q8_0", rows, cols, rng)
    path = tmp_path / "emb.bin"
    path.write_bytes(b"\0" * 32 + raw.tobytes())
    mm = np.memmap(path, dtype=np.uint8, mode="r", offset=32, shape=(raw.size,))
    ids = np.array([1, 299, 42, 42])
    got = dequantize_rows(mm, T.Q8_0, (rows, cols), ids)
    assert type(got) is np.ndarray
    assert_bits_equal(got, reference("Q8_0", raw, rows, cols)[ids])
    del mm


# ---------------------------------------------------------------------------
# memory and speed


def _peak_traced(fn):
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        result = fn()
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    return result, peak


@pytest.mark.parametrize("name", ["Q8_0", "Q4_K", "Q6_K", "F16"])
def test_peak_memory_is_bounded(name, rng):
    rows, cols = 8192, 768
    raw = random_tensor(name, rows, cols, rng)
    out, peak = _peak_traced(lambda: dequantize(raw, T[name], (rows, cols)))
    assert peak >= out.nbytes  # tracemalloc does see numpy's buffers
    # output (20-25 MB) plus bounded per-chunk temporaries
    assert peak < out.nbytes + 48 * 2**20, (peak, out.nbytes)


@pytest.mark.slow
def test_embedding_sized_q8_0_peak_memory():
    rows, cols = 262144, 640
    rng = np.random.default_rng(0)
    raw = random_tensor("Q8_0", rows, cols, rng)
    out, peak = _peak_traced(lambda: dequantize(raw, T.Q8_0, (rows, cols)))
    assert out.shape == (rows, cols)
    assert out.nbytes <= peak < 1.1 * out.nbytes, (peak, out.nbytes)


@pytest.mark.slow
@pytest.mark.parametrize("name", ALL_TYPES)
def test_throughput_4096x1024(name):
    rows, cols = 4096, 1024
    raw = random_tensor(name, rows, cols, np.random.default_rng(1))
    dequantize(raw, T[name], (rows, cols))  # warm-up
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        out = dequantize(raw, T[name], (rows, cols))
        best = min(best, time.perf_counter() - t0)
    mbps = out.nbytes / best / 1e6
    print(f"\n{name}: {mbps:.0f} MB/s of float32 output ({best * 1e3:.1f} ms)")
    assert mbps > 200
