"""kernels/cpu/quantized.py: products that read the GGUF's integer codes directly.

The codes, scales and offsets must reproduce ggml's dequantized weights
exactly, and the product must equal the float32 product up to summation order.
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernels.cpu import CPUBackend  # noqa: E402
from kernels.cpu import backend as cpu_backend  # noqa: E402
from kernels.cpu import quantized  # noqa: E402
from shared.dequant import dequantize  # noqa: E402

pytestmark = pytest.mark.skipif(not quantized.available(), reason="numba is not installed")

QUANT_TYPES = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"]


def random_tensor(name: str, n_out: int, n_in: int, rng: np.random.Generator) -> np.ndarray:
    """Random blocks of type `name` with finite fp16 scales (random bytes there could be inf/nan)."""
    ggml_type = T[name]
    block_size, type_size = GGML_QUANT_SIZES[ggml_type]
    blocks = rng.integers(0, 256, size=(n_out * n_in // block_size, type_size), dtype=np.uint8)
    d_at, m_at = quantized._SCALE_FIELDS[int(ggml_type)]
    for at in (d_at, m_at):
        if at is not None:
            blocks[:, at:at + 2] = (rng.standard_normal((len(blocks), 1)) * 0.01).astype(np.float16).view(np.uint8)
    return blocks.reshape(-1)


def reference(x: np.ndarray, raw: np.ndarray, name: str, shape: tuple[int, int]) -> np.ndarray:
    return x.astype(np.float64) @ dequantize(raw, T[name], shape).astype(np.float64).T


def assert_product_close(actual: np.ndarray, expected: np.ndarray) -> None:
    scale = np.abs(expected).max()
    np.testing.assert_allclose(actual, expected, rtol=0, atol=2e-5 * scale)


@pytest.mark.parametrize("name", QUANT_TYPES)
def test_codes_reproduce_ggml_weights_exactly(name):
    rng = np.random.default_rng(sum(map(ord, name)))
    shape = (70, 512)                  # 70 outputs: not a multiple of the 64-output tile
    raw = random_tensor(name, *shape, rng)
    codes, scale, offset = quantized.split_codes(raw, T[name], shape)
    block = GGML_QUANT_SIZES[T[name]][0]
    weight = (codes.reshape(shape[0], -1, block) * scale[:, :, None]).reshape(shape) + np.repeat(offset, 16, axis=1)
    np.testing.assert_array_equal(weight, dequantize(raw, T[name], shape))
    assert codes.dtype == np.int16 and scale.shape == (70, 512 // block) and offset.shape == (70, 512 // 16)
    m = quantized.quantize_parts([(raw, T[name], shape)])
    assert m is not None and m.out_features == 70 and m.in_features == 512
    # 4/5/8-bit codes fit a byte; k-quant codes carry their sub-block scale and may need two
    assert m.codes.dtype == np.int8 or (name.endswith("_K") and m.codes.dtype == np.int16)
    assert m.group == (16 if name == "Q2_K" else 32)   # Q2_K's minimum changes every 16 inputs


@pytest.mark.parametrize("name", QUANT_TYPES)
@pytest.mark.parametrize("rows", [1, 3, 4])
def test_product_equals_float32_product(name, rows):
    rng = np.random.default_rng(rows * 100 + sum(map(ord, name)))
    shape = (130, 768)
    raw = random_tensor(name, *shape, rng)
    m = quantized.quantize_parts([(raw, T[name], shape)])
    x = rng.standard_normal((rows, shape[1])).astype(np.float32)
    out = quantized.matmul(x, m)
    assert out.shape == (rows, 130) and out.dtype == np.float32
    assert_product_close(out, reference(x, raw, name, shape))


def test_stacked_parts_of_different_types():
    """Fused Q|K|V as in Gemma 3's files (Q5_0, Q5_0, Q8_0), and a k-quant stacked with a 4-bit type."""
    rng = np.random.default_rng(7)
    for names in (["Q5_0", "Q5_0", "Q8_0"], ["Q4_K", "Q4_1", "Q6_K"]):
        parts = [(random_tensor(n, 64 * (i + 1), 512, rng), T[n], (64 * (i + 1), 512)) for i, n in enumerate(names)]
        m = quantized.quantize_parts(parts)
        assert m is not None and m.out_features == 64 + 128 + 192
        x = rng.standard_normal((2, 512)).astype(np.float32)
        expected = np.concatenate([reference(x, raw, n, shape) for (raw, _, shape), n in zip(parts, names)], axis=1)
        assert_product_close(quantized.matmul(x, m), expected)


def test_types_without_codes_and_non_finite_scales_fall_back_to_float32():
    rng = np.random.default_rng(3)
    w = rng.standard_normal((64, 256)).astype(np.float32)
    f16 = w.astype(np.float16).view(np.uint8).reshape(-1)
    assert quantized.quantize_parts([(f16, T.F16, w.shape)]) is None
    # a Q8_0 block whose fp16 scale is nan: the exactness check cannot pass, so sgemm serves every product
    raw = random_tensor("Q8_0", 64, 256, rng).reshape(-1, 34)
    raw[5, 0:2] = np.array([np.nan], np.float16).view(np.uint8)
    assert quantized.quantize_parts([(raw.reshape(-1), T.Q8_0, (64, 256))]) is None


def test_backend_uses_codes_for_few_rows_and_sgemm_for_many():
    rng = np.random.default_rng(11)
    shape = (192, 512)
    raw = random_tensor("Q4_K", *shape, rng)
    dense = dequantize(raw, T.Q4_K, shape)
    ops = CPUBackend()
    w = ops.prepare_weight(dense, [(raw, T.Q4_K, shape)])
    assert w.codes is not None
    np.testing.assert_array_equal(w.dense, dense.T)
    for rows in (1, quantized.COMPILED_MAX_ROWS, quantized.COMPILED_MAX_ROWS + 1, 12, 16, 32):   # 5, 12: padded
        x = rng.standard_normal((rows, shape[1])).astype(np.float32)
        assert_product_close(ops.matmul(x, w), x.astype(np.float64) @ dense.astype(np.float64).T)
    # the switch itself: a product the codes cannot give (poisoned codes) shows which path ran
    poisoned = cpu_backend.Linear(w.dense, quantized.QuantizedMatrix(
        np.zeros_like(w.codes.codes), w.codes.scale, w.codes.offset, 192, 512, w.codes.group))
    x1 = rng.standard_normal((1, 512)).astype(np.float32)
    xn = rng.standard_normal((quantized.COMPILED_MAX_ROWS + 1, 512)).astype(np.float32)
    assert not np.allclose(ops.matmul(x1, poisoned), x1 @ w.dense)
    # sgemm (5 rows are padded to 8: OpenBLAS's kernels for 8 and 5 rows may round differently)
    np.testing.assert_allclose(ops.matmul(xn, poisoned), xn @ w.dense, rtol=1e-5, atol=1e-5)
    # and a backend told not to keep codes
    assert CPUBackend(quantized_matmul=False).prepare_weight(dense, [(raw, T.Q4_K, shape)]).codes is None


def test_a_pass_keeps_the_kernels_its_token_count_chose():
    """begin_pass(n) decides for the whole forward: the last layer's FFN and the logits of a
    12-token pass run on one row but stay on sgemm; a 1-token pass stays on the codes."""
    rng = np.random.default_rng(3)
    shape = (192, 512)
    raw = random_tensor("Q4_K", *shape, rng)
    dense = dequantize(raw, T.Q4_K, shape)
    ops = CPUBackend(quantized_matmul=True)
    w = ops.prepare_weight(dense, [(raw, T.Q4_K, shape)])
    poisoned = cpu_backend.Linear(w.dense, quantized.QuantizedMatrix(
        np.zeros_like(w.codes.codes), w.codes.scale, w.codes.offset, 192, 512, w.codes.group))
    x1 = rng.standard_normal((1, 512)).astype(np.float32)
    ops.begin_pass(12)
    np.testing.assert_array_equal(ops.matmul(x1, poisoned), x1 @ w.dense)
    ops.begin_pass(1)
    assert not np.allclose(ops.matmul(x1, poisoned), x1 @ w.dense)
    ops.begin_pass(quantized.COMPILED_MAX_ROWS + 1)
    np.testing.assert_array_equal(ops.matmul(x1, poisoned), x1 @ w.dense)


def test_the_sampled_rows_logits_of_a_prompt_chunk_read_the_codes(tmp_path, monkeypatch):
    """A 12-token chunk runs its layers on sgemm, but its one sampled row's logits product goes by
    its own row count to the codes (poisoned here, so the path shows in the logprob). The float
    paths: without the 8-bit products that a VNNI CPU would take for this all-Q8_0 model."""
    monkeypatch.setenv("TS_INT8_MATMUL", "0")
    from shared.sampling_params import SamplingParams
    from shared.step import SeqChunk, StepRequest
    from tests.tiny_models import write_tiny_llama
    from worker.model_runner import ModelRunner

    path = write_tiny_llama(tmp_path / "q8.gguf", default_matrix_type=T.Q8_0, d_model=64, vocab=96)
    runner = ModelRunner(path, kv_memory=2**20)
    out = runner.model.output
    assert out.codes is not None
    ids = np.arange(3, 15)
    greedy = SamplingParams(max_tokens=1, temperature=0.0, logprobs=0)

    def logprob(seq_id: int) -> float:
        return runner.execute(StepRequest([SeqChunk(seq_id, ids, 0, np.array([0]), len(ids), params=greedy)])
                              ).results[0].logprob

    clean = logprob(1)
    runner.model.output = cpu_backend.Linear(out.dense, quantized.QuantizedMatrix(
        np.zeros_like(out.codes.codes), out.codes.scale, out.codes.offset, out.codes.out_features,
        out.codes.in_features, out.codes.group))
    assert logprob(2) != pytest.approx(clean, abs=1e-3)
    # the codes' logits are the float32 ones (forward_logits keeps the pass's sgemm for them)
    runner.model.output = out
    logits = runner.forward_logits([SeqChunk(3, ids, 0, np.array([0]), len(ids), sample=False)])[0]
    shifted = logits.astype(np.float64) - logits.max()
    assert clean == pytest.approx(-np.log(np.exp(shifted).sum()), abs=1e-4)   # greedy: the max logit
