"""kernels/cpu/int8_matmul.py: 8-bit integer products (AVX-512 VNNI, or AVX2), checked against the
definitions written out here in numpy: each input row coded in two 8-bit levels (ggml's
quantize_row_q8_0, then the same coding of its remainder) and the product
sum_g sum_l (d_w * d_l) * sum(code * q_l) + m_w * s, s the group's float sum."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernels.cpu import CPUBackend, int8_matmul, int8_weights  # noqa: E402
from shared.dequant import dequantize  # noqa: E402
from test_quantized_matmul import random_tensor  # noqa: E402

pytestmark = pytest.mark.skipif(not int8_matmul.available(), reason="needs numba and a CPU with AVX2")

BYTE_CODE_TYPES = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"]


def two_level_coding(x: np.ndarray, group: int):
    """Level 0 as ggml-cpu's quantize_row_q8_0 (d = max / 127, q0 = round_even(x * (127 / max))), level 1
    what it leaves in steps of d / 254 (q1 = round_even(rest * (127 / max * 254)), within +-127); s the
    group's sum. Returns (q0, q1, d / 254, 254 * sum(q0) + sum(q1)), s."""
    x = x.astype(np.float32).reshape(x.shape[0], -1, group)
    s = x.astype(np.float64).sum(axis=2)
    amax = np.abs(x).max(axis=2)
    coded = amax >= np.float32(2.0 ** -100)
    with np.errstate(divide="ignore", over="ignore"):
        d = np.where(coded, amax / np.float32(127), np.float32(0)).astype(np.float32)
        inv = np.where(coded, np.float32(127) / amax, np.float32(0)).astype(np.float32)
    q0 = np.rint(x * inv[:, :, None]).astype(np.int64)
    rest = (x - d[:, :, None] * q0.astype(np.float32)).astype(np.float32)
    q1 = np.clip(np.rint(rest * (inv * np.float32(254))[:, :, None]), -127, 127).astype(np.int64)
    return (q0, q1, (d / np.float32(254)).astype(np.float32), 254 * q0.sum(axis=2) + q1.sum(axis=2)), s


def byte_codes(raw: np.ndarray, name: str, shape: tuple[int, int]):
    """The kernel's codes, checked to give back ggml's weights exactly: fl(scale * code) + offset."""
    codes, scale, offset, group = int8_weights._byte_split(raw, int(T[name]), shape, None)
    rebuilt = (codes.reshape(shape[0], -1, group) * scale[:, :, None]).astype(np.float32) + offset[:, :, None]
    np.testing.assert_array_equal(rebuilt.reshape(shape), dequantize(raw, T[name], shape))
    return codes, scale, offset, group


def stored_bias(codes: np.ndarray) -> int:
    """VNNI multiplies unsigned codes (signed ones stored + 128); AVX2 stores codes spanning at most
    129 values as code - min (unsigned), wider ones (Q8_0) signed."""
    if int8_matmul.VNNI:
        return 128 if codes.min() < 0 else 0
    lo, hi = int(min(codes.min(), 0)), int(codes.max())
    return -lo if hi - lo <= 129 else 0


def coded_product(x: np.ndarray, codes, scale, offset, group) -> np.ndarray:
    n_out = codes.shape[0]
    (q0, q1, step, _), s = two_level_coding(x, group)
    out = (offset[None] * s[:, None, :]).sum(-1)
    by_group = codes.astype(np.int64).reshape(n_out, -1, group)
    isum = 254 * np.einsum("rgk,ngk->rng", q0, by_group) + np.einsum("rgk,ngk->rng", q1, by_group)
    return out + (isum * scale[None] * step.astype(np.float64)[:, None, :]).sum(-1)


@pytest.mark.parametrize("name", BYTE_CODE_TYPES)
@pytest.mark.parametrize("rows", [1, 3, 4, 9])
def test_product_is_the_two_level_coded_dot(name, rows):
    rng = np.random.default_rng(sum(map(ord, name)) + rows)
    shape = (70, 512)          # 70 outputs: three 32-output tiles, the last one partly padding
    raw = random_tensor(name, *shape, rng)
    codes, scale, offset, group = byte_codes(raw, name, shape)
    assert group == (16 if name == "Q6_K" else 32)
    w = int8_matmul.from_parts([(raw, T[name], shape)])
    assert w is not None and w.bias == stored_bias(codes) and w.group == group
    x = rng.standard_normal((rows, shape[1])).astype(np.float32)
    x[0, :32] = 0.0            # an all-zero group: d = 0, q = 0
    out = int8_matmul.matmul(x, w)
    expected = coded_product(x, codes, scale, offset, group)
    assert out.shape == (rows, 70)
    np.testing.assert_allclose(out, expected, rtol=0, atol=1e-5 * np.abs(expected).max())
    # and, with the remainder's level, the float product to float32's order
    exact = x.astype(np.float64) @ dequantize(raw, T[name], shape).astype(np.float64).T
    np.testing.assert_allclose(out, exact, rtol=0, atol=2e-4 * np.abs(exact).max())


@pytest.mark.parametrize("code", [-128, 127])
def test_largest_codes_times_largest_inputs_do_not_saturate(code):
    """AVX2's vpmaddubsw sums two byte products in 16 bits with saturation: |code| <= 128 and
    |q| <= 127 keep every pair in range (2 * 128 * 127 = 32512), for both signs of the input."""
    shape = (32, 64)
    raw = np.zeros((shape[0], shape[1] // 32, 34), np.uint8)
    raw[:, :, :2] = np.float16([0.5]).view(np.uint8)      # d = 0.5 in every block
    raw[:, :, 2:] = np.int8([code]).view(np.uint8)
    raw = raw.reshape(-1)
    w = int8_matmul.from_parts([(raw, T.Q8_0, shape)])
    assert w is not None
    x = np.ones((2, shape[1]), np.float32)
    x[1] = -1.0                                           # q = +127 and -127 in every group
    expected = np.float32(0.5 * code * shape[1]) * x[:, :1]
    np.testing.assert_array_equal(int8_matmul.matmul(x, w), np.broadcast_to(expected, (2, shape[0])))


@pytest.mark.parametrize("name, largest", [("Q4_1", 15), ("Q5_1", 31), ("Q6_K", 63)])
@pytest.mark.parametrize("sign", [1, -1])
def test_runs_summed_in_16_bits_do_not_overflow(name, largest, sign):
    """AVX2 adds the 16-bit pair sums of a run of steps (a whole group of 32 inputs for 4-bit codes)
    before widening them: every code at its largest times inputs of +-127 in every group must still
    give the exact product, as a sum the einsum of coded_product takes in 64 bits."""
    rng = np.random.default_rng(largest)
    shape = (64, 256)
    raw = random_tensor(name, *shape, rng)
    codes, scale, offset, group = byte_codes(raw, name, shape)
    w = int8_matmul.from_parts([(raw, T[name], shape)])
    assert w is not None
    if not int8_matmul.VNNI:
        assert w.run == {15: 8, 31: 4, 63: 2}[largest] and w.bias == stored_bias(codes)
    # the same scales and offsets with every stored code at its largest
    top = int(codes.max())
    assert top - int(min(codes.min(), 0)) == largest
    full = np.full_like(codes, top)
    w_full = int8_matmul.Int8Matrix(np.full_like(w.codes, top + w.bias), w.scale, w.offset,
                                    w.bias, w.out_features, w.in_features, w.group, w.run)
    x = np.full((1, shape[1]), sign, np.float32)                  # q = +-127 in every group
    expected = coded_product(x, full, scale, offset, group)
    np.testing.assert_allclose(int8_matmul.matmul(x, w_full), expected, rtol=0, atol=1e-5 * np.abs(expected).max())


def test_parts_of_different_types_stack_on_the_finer_groups():
    """A fused Q|K|V of Q4_K, Q4_K and Q6_K (Gemma 3's mix): groups of 16 throughout, biased codes."""
    rng = np.random.default_rng(1)
    parts = [(random_tensor(n, 32, 256, rng), T[n], (32, 256)) for n in ("Q4_K", "Q4_K", "Q6_K")]
    w = int8_matmul.from_parts(parts)
    codes = np.concatenate([byte_codes(raw, T(t).name, shape)[0] for raw, t, shape in parts])
    assert codes.min() < 0                                # Q6_K's codes are q - 32
    assert w is not None and w.group == 16 and w.bias == stored_bias(codes) and w.out_features == 96
    x = rng.standard_normal((5, 256)).astype(np.float32)
    dense = np.concatenate([dequantize(raw, t, shape) for raw, t, shape in parts])
    exact = x.astype(np.float64) @ dense.astype(np.float64).T
    np.testing.assert_allclose(int8_matmul.matmul(x, w), exact, rtol=0, atol=2e-4 * np.abs(exact).max())


def test_each_row_is_computed_alone():
    """A row's result does not depend on the rows beside it (4-row and 1-row micro-kernels agree bit for bit)."""
    rng = np.random.default_rng(7)
    shape = (96, 128)
    raw = random_tensor("Q4_1", *shape, rng)
    w = int8_matmul.from_parts([(raw, T.Q4_1, shape)])
    x = rng.standard_normal((7, shape[1])).astype(np.float32)
    together = int8_matmul.matmul(x, w)
    for i in range(7):
        np.testing.assert_array_equal(together[i], int8_matmul.matmul(x[i:i + 1], w)[0])


@pytest.mark.parametrize("name", ["Q4_1", "Q6_K"])
def test_two_tiles_read_at_once_give_each_tile_as_alone(name):
    """The one-row kernel that streams two tiles together (the replayed decode products) gives
    both tiles' outputs bit for bit as the one-tile kernel does, offsets and groups of 16 included."""
    from numba import njit

    @njit
    def both_ways(w_codes, qx, dx, sx, qbias, scale, offset, n_tiles, group, run, pairs, alone):
        for t in range(n_tiles):
            int8_matmul._tile_rows1(w_codes, qx, dx, sx, qbias, scale, offset, alone, t, 0, group, run)
        for t in range(n_tiles // 2):
            int8_matmul._tile_pair1(w_codes, qx, dx, sx, qbias, scale, offset, pairs, t, n_tiles - 1 - t, 0, group,
                                    run)

    rng = np.random.default_rng(11)
    shape = (160, 512)
    w = int8_matmul.from_parts([(random_tensor(name, *shape, rng), T[name], shape)])
    x = rng.standard_normal((1, shape[1])).astype(np.float32)
    q, d, s, qsum = int8_matmul.quantize_rows(x, w.group)
    qbias = (qsum * np.int32(w.bias)).astype(np.int32)
    pairs, alone = (np.zeros((1, w.n_tiles * int8_matmul.TILE), np.float32) for _ in range(2))
    both_ways(w.codes, q, d, s, qbias, w.scale, w.offset, w.n_tiles, w.group, w.run, pairs, alone)
    assert w.n_tiles == 5 and np.abs(alone).max() > 0
    np.testing.assert_array_equal(alone, int8_matmul.matmul(x, w))
    paired = np.r_[0:64, 96:160]                          # five tiles of 32: pairs (0, 4) and (1, 3)
    np.testing.assert_array_equal(pairs[:, paired], alone[:, paired])


@pytest.mark.parametrize("group", [16, 32])
def test_input_coding_matches_its_definition(group):
    """kernels/cpu/input_coding.py against two_level_coding: codes, steps and code sums exactly,
    the group sums to float32's rounding (summed in another order)."""
    rng = np.random.default_rng(group)
    rows, k = 6, 8 * group
    x = (rng.standard_normal((rows, k)) * 10.0 ** rng.integers(-4, 4, (rows, k // group)).repeat(group, 1))
    x = x.astype(np.float32)
    x[1, :group] = 0.0                                   # an all-zero group: every code 0
    x[2, group:2 * group] = 127 / 64                     # d = 1/64 exactly: level 1 has nothing left
    x[3, :group] = rng.standard_normal(group) * 2.0 ** -110    # below 2**-100: coded as zeros
    x[4, :group] = np.float32(2.0 ** -40) * rng.standard_normal(group).astype(np.float32)
    q, d, s, qsum = int8_matmul.quantize_rows(x, group)
    (q0, q1, step, total), want_s = two_level_coding(x, group)
    np.testing.assert_array_equal(q[0].reshape(rows, -1, group), q0)
    np.testing.assert_array_equal(q[1].reshape(rows, -1, group), q1)
    np.testing.assert_array_equal(d, step)
    np.testing.assert_array_equal(qsum, total)
    np.testing.assert_allclose(s, want_s, rtol=1e-6, atol=1e-6 * np.abs(x).max())
    assert not q[:, 1, :group].any() and not d[1, 0] and not q[:, 3, :group].any() and not d[3, 0]
    assert not q[1, 2, group:2 * group].any()
    assert np.abs(q[0, 4, :group]).max() == 127           # a small group is coded at its own scale


@pytest.mark.parametrize("group", [16, 32])
def test_two_levels_rebuild_the_input_to_half_a_step(group):
    """What level 0 leaves is at most half its step, so level 1's codes stay within +-127 (ties of
    level 0's rounding included, which reach 127) and (d / 254) * (254 * q0 + q1) gives back each
    input within half a step (and float32's rounding)."""
    rng = np.random.default_rng(100 + group)
    x = (rng.standard_normal((64, 16 * group)) * 10.0 ** rng.integers(-6, 6, (64, 16)).repeat(group, 1))
    x = x.astype(np.float32)
    x[0, :group] = np.arange(group) - group / 2 + 0.5      # d = 1: every other input a tie of level 0's rounding
    x[0, 0] = 127.0
    q, d, _, _ = int8_matmul.quantize_rows(x, group)
    assert np.abs(q[1].astype(np.int32)).max() <= 127 and 127 in np.abs(q[1, 0, :group])
    step = np.repeat(d, group, axis=1).astype(np.float64)
    rebuilt = step * (254 * q[0].astype(np.float64) + q[1])
    assert (np.abs(rebuilt - x) / step).max() <= 0.5 + 1e-3


def test_a_model_with_other_types_stays_on_the_float_paths():
    rng = np.random.default_rng(11)
    shape = (64, 256)
    raw = random_tensor("Q3_K", *shape, rng)
    assert int8_matmul.from_parts([(raw, T.Q3_K, shape)]) is None
    ops = CPUBackend(quantized_matmul=True, int8=True)
    ops.plan_weights({int(T.Q8_0), int(T.Q3_K)})      # one Q3_K matrix: no 8-bit products at all
    assert not ops.int8_matmul
    q8 = random_tensor("Q8_0", *shape, rng)
    w = ops.prepare_weight(dequantize(q8, T.Q8_0, shape), [(q8, T.Q8_0, shape)])
    assert w.int8 is None and w.dense is not None


def test_backend_keeps_the_byte_codes(monkeypatch):
    rng = np.random.default_rng(5)
    shape = (64, 256)
    raw = random_tensor("Q8_0", *shape, rng)
    dense = dequantize(raw, T.Q8_0, shape)
    ops = CPUBackend(quantized_matmul=True, int8=True)
    ops.plan_weights({int(T.Q8_0), int(T.Q4_1)})
    w = ops.prepare_weight(dense, [(raw, T.Q8_0, shape)])
    assert w.int8 is not None and w.codes is None
    assert w.dense is None                             # the 8-bit kernel takes every product
    x = rng.standard_normal((12, shape[1])).astype(np.float32)
    ops.begin_pass(12)
    np.testing.assert_allclose(ops.matmul(x, w), x @ dense.T, rtol=0, atol=2e-4 * np.abs(x @ dense.T).max())
    monkeypatch.setenv("TS_INT8_MATMUL", "0")
    assert not CPUBackend(quantized_matmul=True).int8_allowed
    monkeypatch.setenv("TS_INT8_MATMUL", "1")
    assert CPUBackend(quantized_matmul=True).int8_allowed


def test_every_pass_takes_the_8_bit_products_where_the_matrices_have_them():
    """Decode passes of any size and prompts alike (VNNI and AVX2): each row is computed the same
    way whatever rows share its pass, the sign trick's codes included."""
    rng = np.random.default_rng(8)
    ops = CPUBackend(quantized_matmul=True, int8=True)
    ops.plan_weights({int(T.Q4_K), int(T.Q8_0)})
    assert ops.int8_matmul
    q8 = random_tensor("Q8_0", 128, 256, rng)        # full-range codes: signed on AVX2
    w8 = ops.prepare_weight(dequantize(q8, T.Q8_0, (128, 256)), [(q8, T.Q8_0, (128, 256))])
    assert w8.int8 is not None and w8.dense is None
    assert ops.decode_batches_in_int8
    for rows, decode in ((32, True), (4, True), (32, False), (512, False)):
        ops.begin_pass(rows, decode=decode)
        assert ops._compiled_pass
    x = rng.standard_normal((53, 256)).astype(np.float32)
    ops.begin_pass(53)
    full = ops.matmul(x, w8)
    ops.begin_pass(5)
    np.testing.assert_array_equal(ops.matmul(x[48:], w8), full[48:])
