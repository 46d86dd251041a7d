"""CUDABackend against CPUBackend, method by method, on random and real inputs, and both bundled
models end to end: greedy tokens equal to the CPU's and to llama.cpp's, teacher-forced scores
within the agreement bar (tests/agreement.py). Marked gpu: skipped unless CuPy sees a device
(make gpu-check runs them)."""
from __future__ import annotations

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T

from agreement import Agreement, greedy_prefix_to_check
from conftest import MODELS, load_fixture
from kernels import AttentionMetadata
from shared.dequant import dequantize, dequantize_rows


def _gpu() -> bool:
    try:
        import cupy
        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:       # no CuPy, no driver, no device
        return False


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _gpu(), reason="needs CuPy and a CUDA GPU (make gpu-check)")]


@pytest.fixture(scope="module")
def cuda():
    from kernels.cuda.backend import CUDABackend
    return CUDABackend()


@pytest.fixture(scope="module")
def cpu():
    from kernels.cpu import CPUBackend
    return CPUBackend()          # no plan_weights: float32 paths, the plain reference


def _rel_err(got: np.ndarray, ref: np.ndarray) -> float:
    return float(np.abs(got.astype(np.float64) - ref).max() / max(np.abs(ref).max(), 1e-30))


_HALF_FIELDS = {T.Q4_0: (0,), T.Q4_1: (0, 2), T.Q5_0: (0,), T.Q5_1: (0, 2), T.Q8_0: (0,), T.Q4_K: (0, 2),
                T.Q5_K: (0, 2), T.Q6_K: (208,), T.Q3_K: (108,)}


def _random_matrix(ggml_type: int, n_out: int, n_in: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    block, size = GGML_QUANT_SIZES[T(ggml_type)]
    if ggml_type in (T.F32, T.F16, T.BF16):
        w = rng.standard_normal((n_out, n_in)).astype(np.float32) * 0.05
        return (w if ggml_type == T.F32 else w.astype(np.float16) if ggml_type == T.F16
                else (w.view(np.uint32) >> 16).astype(np.uint16)).view(np.uint8).reshape(-1)
    raw = rng.integers(0, 256, (n_out * n_in // block, size), dtype=np.uint8)
    for off in _HALF_FIELDS[T(ggml_type)]:
        raw[:, off:off + 2] = (rng.standard_normal(len(raw)) * 0.01).astype(np.float16).view(np.uint8).reshape(-1, 2)
    return raw.reshape(-1)


TYPES = [T.F32, T.F16, T.BF16, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K, T.Q3_K]


@pytest.mark.parametrize("rows", [1, 3, 8, 9, 64])
@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
def test_matmul_from_blocks(cuda, ggml_type, rows):
    n_out, n_in = 96, 512
    raw = _random_matrix(ggml_type, n_out, n_in, int(ggml_type))
    w = dequantize(raw, ggml_type, (n_out, n_in))
    lin = cuda.prepare_weight(w, [(raw, int(ggml_type), (n_out, n_in))])
    x = np.random.default_rng(rows).standard_normal((rows, n_in)).astype(np.float32)
    got = cuda.to_numpy(cuda.matmul(cuda.asarray(x), lin))
    ref = x.astype(np.float64) @ w.T.astype(np.float64)
    # GEMV accumulates float32 over exact weights; cuBLAS multiplies float16 roundings of both sides
    assert _rel_err(got, ref) < (2e-5 if rows < cuda.variant["prefill_min_rows"] else 5e-3)


@pytest.mark.parametrize("rows", [1, 5, 40])
def test_matmul_of_stacked_parts_of_mixed_types(cuda, rows):
    shapes = [(64, 256, T.Q4_K), (32, 256, T.Q8_0), (32, 256, T.Q3_K)]    # Q3_K: float32 from the host
    parts = [(_random_matrix(t, o, i, k), int(t), (o, i)) for k, (o, i, t) in enumerate(shapes)]
    w = np.concatenate([dequantize(r, t, s) for r, t, s in parts])
    x = np.random.default_rng(0).standard_normal((rows, 256)).astype(np.float32)
    got = cuda.to_numpy(cuda.matmul(cuda.asarray(x), cuda.prepare_weight(w, parts)))
    assert _rel_err(got, x.astype(np.float64) @ w.T) < (2e-5 if rows < cuda.variant["prefill_min_rows"] else 5e-3)


@pytest.mark.parametrize("model", MODELS)
def test_real_matrices_and_embedding_rows(cuda, model):
    from shared.gguf_file import GGUFFile
    from shared.model_registry import resolve_model
    gguf = GGUFFile(resolve_model(model))
    seen = set()
    for name, t in gguf.tensors.items():
        if len(t.shape) != 2 or t.ggml_type in seen:
            continue
        seen.add(t.ggml_type)
        raw = gguf.raw(name)
        rows = np.array([0, 1, t.shape[0] // 2, t.shape[0] - 1])
        if name == "token_embd.weight" or t.shape[0] > 100_000:
            table = cuda.prepare_embedding(raw, t.ggml_type, t.shape)
            np.testing.assert_array_equal(cuda.to_numpy(cuda.embedding(table, rows)),
                                          dequantize_rows(raw, t.ggml_type, t.shape, rows))
            continue
        w = dequantize(raw, t.ggml_type, t.shape)
        lin = cuda.prepare_weight(w, [(raw, t.ggml_type, tuple(t.shape))])
        for n in (1, 32):
            x = np.random.default_rng(n).standard_normal((n, t.shape[1])).astype(np.float32)
            got = cuda.to_numpy(cuda.matmul(cuda.asarray(x), lin))
            assert _rel_err(got, x.astype(np.float64) @ w.T) < (2e-5 if n == 1 else 5e-3), (name, n)


def test_rms_norm_rope_and_qk_norm(cuda, cpu):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((7, 6, 64)).astype(np.float32) * 3
    w = rng.standard_normal((6, 64)).astype(np.float32)
    pos = np.array([0, 1, 2, 100, 5000, 7, 3], np.int64)
    np.testing.assert_allclose(cuda.to_numpy(cuda.rms_norm(cuda.asarray(x), cuda.asarray(w), 1e-6)),
                               cpu.rms_norm(x, w, 1e-6), rtol=2e-6, atol=1e-6)
    flat = x.reshape(7, -1)
    np.testing.assert_allclose(cuda.to_numpy(cuda.rms_norm(cuda.asarray(flat), cuda.asarray(flat[0]), 1e-5)),
                               cpu.rms_norm(flat, flat[0], 1e-5), rtol=2e-6, atol=1e-6)
    for neox in (False, True):
        for n_dims in (64, 32):
            got = cuda.to_numpy(cuda.rope(cuda.asarray(x), pos, 10000.0, n_dims, neox))
            np.testing.assert_allclose(got, cpu.rope(x, pos, 10000.0, n_dims, neox), rtol=1e-6, atol=1e-6)
        fused = cuda.to_numpy(cuda.qk_norm_rope(cuda.asarray(x), cuda.asarray(w), 1e-6, pos, 1e6, 64, neox))
        np.testing.assert_allclose(fused, cpu.rope(cpu.rms_norm(x, w, 1e-6), pos, 1e6, 64, neox), rtol=1e-5, atol=1e-5)


def test_gated_activations_on_column_slices(cuda, cpu):
    gu = (np.random.default_rng(2).standard_normal((9, 2 * 300)) * 4).astype(np.float32)
    gu[0, :5] = [-100.0, 100.0, 0.0, -88.5, 40.0]
    dev = cuda.asarray(gu)
    for name in ("swiglu", "gelu_tanh_gate"):
        got = cuda.to_numpy(getattr(cuda, name)(dev[:, :300], dev[:, 300:]))
        np.testing.assert_allclose(got, getattr(cpu, name)(gu[:, :300], gu[:, 300:]), rtol=1e-5, atol=1e-6)


def test_log_softmax_top_k_argmax(cuda, cpu):
    x = (np.random.default_rng(3).standard_normal((4, 1000)) * 5).astype(np.float32)
    np.testing.assert_allclose(cuda.to_numpy(cuda.log_softmax(cuda.asarray(x))), cpu.log_softmax(x), atol=1e-5)
    ids, vals = cuda.top_k(cuda.asarray(x), 8)
    ref_ids, ref_vals = cpu.top_k(x, 8)
    np.testing.assert_array_equal(ids, ref_ids)
    np.testing.assert_array_equal(vals, ref_vals)
    x[2, 17] = np.nan
    x[3, 5] = x[3].max() + 1
    x[3, 900] = x[3, 5]                   # a tie: the first index
    np.testing.assert_array_equal(cuda.argmax(cuda.asarray(x)), [np.argmax(x[0]), np.argmax(x[1]), -1, 5])


def test_sampling_on_the_device(cuda):
    rng = np.random.default_rng(4)
    logits = rng.standard_normal((3, 50)).astype(np.float32) * 2
    dev = cuda.asarray(logits)
    rows = np.ones(3)
    greedy = cuda.sample(dev, np.zeros(3), rows * 0, rows, np.arange(3), np.zeros(3))
    np.testing.assert_array_equal(greedy, logits.argmax(axis=1))
    np.testing.assert_array_equal(cuda.sample(dev, rows, rows, rows, np.arange(3), np.zeros(3)), logits.argmax(1))
    a = cuda.sample(dev, rows, rows * 0, rows, np.array([7, 7, 8]), np.array([3, 3, 3]))
    assert a[0] == a[1] and (cuda.sample(dev, rows, rows * 0, rows, np.array([7, 7, 8]), np.array([3, 3, 3])) == a).all()
    # frequencies of one row's draws over counters follow its softmax; top-p keeps only the nucleus
    n = 4000
    row = np.repeat(logits[:1], n, axis=0)
    draws = cuda.sample(cuda.asarray(row), np.ones(n), np.zeros(n), np.ones(n), np.full(n, 11), np.arange(n))
    p = np.exp(logits[0] - logits[0].max())
    p /= p.sum()
    freq = np.bincount(draws, minlength=50) / n
    assert np.abs(freq - p).max() < 0.03
    order = np.argsort(-p)
    nucleus = set(order[:np.searchsorted(np.cumsum(p[order]), 0.5) + 1].tolist())
    top_p = cuda.sample(cuda.asarray(row), np.ones(n), np.zeros(n), np.full(n, 0.5), np.full(n, 11), np.arange(n))
    assert set(top_p.tolist()) <= nucleus and len(set(top_p.tolist())) == len(nucleus)
    top_k = cuda.sample(cuda.asarray(row), np.ones(n), np.full(n, 3), np.ones(n), np.full(n, 11), np.arange(n))
    assert set(top_k.tolist()) == set(order[:3].tolist())


def _pools(backend, codec, blocks, block_size, kv_heads, dim):
    return backend.alloc_kv(blocks, block_size, kv_heads, dim, codec)


@pytest.mark.parametrize("codec", ["f16", "q8_0", "q4_0"])
@pytest.mark.parametrize("dim,heads,kv_heads,window", [(64, 9, 3, 0), (256, 4, 1, 0), (256, 4, 1, 12), (64, 4, 4, 5)])
def test_store_and_paged_attention(cuda, cpu, codec, dim, heads, kv_heads, window):
    from kernels.cpu import kv_codecs
    rng = np.random.default_rng(dim + heads + window)
    block_size, blocks = 4, 24
    # sequence 0: a 13-token prompt chunk after 6 cached tokens; 1: one decode row at 9; 2: a 3-row chunk from 0
    qlens, ctx = np.array([13, 1, 3]), np.array([19, 10, 3])
    tables = np.stack([rng.permutation(blocks)[:8] for _ in range(3)]).astype(np.int32)
    kc, vc = _pools(cpu, codec, blocks, block_size, kv_heads, dim)
    kg, vg = _pools(cuda, codec, blocks, block_size, kv_heads, dim)
    qk_all = []
    for i in range(3):           # every sequence's K/V, cached ones included, stored through both backends
        pos = np.arange(ctx[i])
        slots = tables[i][pos // block_size].astype(np.int64) * block_size + pos % block_size
        qk = rng.standard_normal((ctx[i], heads + kv_heads, dim)).astype(np.float32)
        v = rng.standard_normal((ctx[i], kv_heads, dim)).astype(np.float32)
        cpu.store_kv(kc, vc, qk[:, heads:], v, slots)
        dev = cuda.asarray(qk)
        cuda.store_kv(kg, vg, dev[:, heads:], cuda.asarray(v), slots)
        qk_all.append(qk[ctx[i] - qlens[i]:, :heads])
    np.testing.assert_array_equal(cuda.to_numpy(kg).reshape(-1).view(np.uint8), kv_codecs.raw(kc).reshape(-1))
    np.testing.assert_array_equal(cuda.to_numpy(vg).reshape(-1).view(np.uint8), kv_codecs.raw(vc).reshape(-1))
    q = np.concatenate(qk_all)
    slots = np.zeros(len(q), np.int64)       # (not read by attention)
    for causal in (True, False):
        meta = AttentionMetadata(qlens, ctx, tables, slots, causal=causal)
        ref = cpu.paged_attention(q, kc, vc, meta, 0.125, window)
        got = cuda.to_numpy(cuda.paged_attention(cuda.asarray(q), kg, vg,
                                                 AttentionMetadata(qlens, ctx, tables, slots, causal=causal), 0.125, window))
        np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-5)
    # a decode pass as the runner builds it
    meta = AttentionMetadata.for_decode(ctx.astype(np.int64), tables.astype(np.int64), slots[:3])
    q3 = rng.standard_normal((3, heads, dim)).astype(np.float32)
    ref = cpu.paged_attention(q3, kc, vc, meta, 0.125, window)
    got = cuda.to_numpy(cuda.paged_attention(cuda.asarray(q3), kg, vg, AttentionMetadata.for_decode(
        ctx.astype(np.int64), tables.astype(np.int64), slots[:3]), 0.125, window))
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-5)
    cpu.copy_blocks(kc, vc, np.array([tables[0, 0]]), np.array([tables[2, 5]]))
    cuda.copy_blocks(kg, vg, np.array([tables[0, 0]]), np.array([tables[2, 5]]))
    np.testing.assert_array_equal(cuda.to_numpy(vg).reshape(-1).view(np.uint8), kv_codecs.raw(vc).reshape(-1))


def test_dense_attention(cuda, cpu):
    rng = np.random.default_rng(5)
    q, k, v = (rng.standard_normal((11, h, 64)).astype(np.float32) for h in (8, 2, 2))
    lens = np.array([4, 7])
    np.testing.assert_allclose(cuda.to_numpy(cuda.dense_attention(cuda.asarray(q), cuda.asarray(k), cuda.asarray(v),
                                                                  lens, 0.125)),
                               cpu.dense_attention(q, k, v, lens, 0.125), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("model", MODELS)
def test_models_greedy_equals_cpu_and_scores_clear_the_bar(cuda, model):
    from cuda_model_harness import PagedModel, top_logprobs
    from kernels.cpu import CPUBackend
    on_gpu, on_cpu = PagedModel(model, cuda, blocks=16), PagedModel(model, CPUBackend(), blocks=16)
    report = Agreement()
    for case in load_fixture(model)["generate"]:
        tokens = case["prompt_tokens"] + case["greedy_continuation"]
        gpu_logits = on_gpu.prefill(tokens, all_rows=True)
        report.add_case(case["teacher_forced"], top_logprobs(gpu_logits))
        n = max(1, greedy_prefix_to_check(case))
        ours = on_gpu.greedy(case["prompt_tokens"], n)
        assert ours == on_cpu.greedy(case["prompt_tokens"], n)
        assert ours == case["greedy_continuation"][:n]
    assert report.passed, report.summary()


@pytest.mark.parametrize("codec", ["q8_0", "q4_0"])
def test_quantized_kv_pools_decode_like_the_cpu(cuda, codec):
    from cuda_model_harness import PagedModel
    from kernels.cpu import CPUBackend
    case = load_fixture("smollm2-135m")["generate"][0]
    on_gpu = PagedModel("smollm2-135m", cuda, codec=codec, blocks=16)
    on_cpu = PagedModel("smollm2-135m", CPUBackend(), codec=codec, blocks=16)
    assert on_gpu.greedy(case["prompt_tokens"], 8) == on_cpu.greedy(case["prompt_tokens"], 8)
