"""The numerics the CUDA kernels share (kernels/cuda/quant_blocks.cuh), run on the host: nvcc
compiles the header's __host__ __device__ functions for the CPU into a shared library
(tests/cuda_host/host_numerics.cu) and each is compared with the project's numpy reference:
GGUF block decoding with shared/dequant.py on the bundled models' real tensors (and on random
blocks of the types they lack), bit for bit; the KV codecs with kernels/cpu/kv_codecs.py, byte
for byte; float16 conversions with numpy's, exhaustively; RoPE's pair rotation; the online softmax.

On the device the float16 conversions are the hardware's (cvt.f32.f16, cvt.rn.f16.f32: the same
values by IEEE's definition); everything else is the code tested here."""
from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T

from shared.dequant import dequantize

ROOT = Path(__file__).resolve().parents[1]
NVCC = shutil.which("nvcc")
pytestmark = pytest.mark.skipif(NVCC is None, reason="nvcc is not installed: the CUDA numerics were not built")
U8, F32P, U16P = (np.ctypeslib.ndpointer(t, flags="C_CONTIGUOUS") for t in (np.uint8, np.float32, np.uint16))
I64, U64, F64P = ctypes.c_longlong, ctypes.c_ulonglong, np.ctypeslib.ndpointer(np.float64, flags="C_CONTIGUOUS")


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    out = tmp_path_factory.mktemp("cuda_host") / "host_numerics.so"
    # no FMA contraction on the host either: the device code spells out its roundings
    r = subprocess.run([NVCC, "-Xcompiler", "-fPIC", "-Xcompiler", "-ffp-contract=off", "-shared", "-x", "cu",
                        "-I", str(ROOT / "kernels" / "cuda"), "-o", str(out),
                        str(ROOT / "tests" / "cuda_host" / "host_numerics.cu")],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    so = ctypes.CDLL(str(out))
    so.ts_dequant.argtypes = [ctypes.c_int, U8, I64, F32P]
    so.ts_halves_to_floats.argtypes = [U16P, I64, F32P]
    so.ts_floats_to_halves.argtypes = [F32P, I64, U16P]
    so.ts_kv_encode.argtypes = [ctypes.c_int, F32P, I64, ctypes.c_int, U8]
    so.ts_kv_decode.argtypes = [ctypes.c_int, U8, I64, ctypes.c_int, F32P]
    so.ts_rope_pairs.argtypes = [F32P] * 4 + [I64, F32P, F32P]
    so.ts_softmax_weighted.argtypes = [F32P, F32P, ctypes.c_int, ctypes.c_int, ctypes.POINTER(ctypes.c_float)]
    so.ts_uniforms.argtypes = [U64, np.ctypeslib.ndpointer(np.uint64, flags="C_CONTIGUOUS"), I64, F64P]
    return so


def _decode(lib, ggml_type: int, raw: np.ndarray) -> np.ndarray:
    block, size = GGML_QUANT_SIZES[T(ggml_type)]
    raw = np.ascontiguousarray(raw, np.uint8)
    out = np.empty(raw.size // size * block, np.float32)
    lib.ts_dequant(ggml_type, raw, raw.size // size, out)
    return out


def _same_bits(a: np.ndarray, b: np.ndarray) -> None:
    """Equal floats bit for bit (NaNs: equal as NaNs)."""
    nan = np.isnan(a)
    np.testing.assert_array_equal(nan, np.isnan(b))
    np.testing.assert_array_equal(a[~nan].view(np.uint32), b[~nan].view(np.uint32))


@pytest.mark.parametrize("model", ["smollm2-135m", "gemma3-270m"])
def test_blocks_of_real_tensors_decode_as_shared_dequant(lib, model):
    from shared.gguf_file import GGUFFile
    from shared.model_registry import resolve_model
    gguf = GGUFFile(resolve_model(model))
    seen = set()
    for name, t in gguf.tensors.items():
        if t.ggml_type == T.F32 and t.ggml_type in seen:
            continue                              # norms: one is enough
        seen.add(t.ggml_type)
        raw = np.asarray(gguf.raw(name)).reshape(-1)
        block, size = GGML_QUANT_SIZES[T(t.ggml_type)]
        n_cols = t.shape[-1]
        rows = max(1, min(int(np.prod(t.shape[:-1])), (1 << 18) // n_cols))   # the first ~256k values
        part = raw[:rows * n_cols // block * size]
        _same_bits(_decode(lib, t.ggml_type, part), dequantize(part, t.ggml_type, (rows, n_cols)).reshape(-1))
    assert seen >= ({T.Q4_1, T.Q8_0} if model.startswith("smollm2") else {T.Q5_0, T.Q4_K, T.Q6_K, T.Q8_0})


# byte offsets of each block's float16 fields (scales, mins): random bytes there would be NaNs
_HALF_FIELDS = {T.Q4_0: (0,), T.Q4_1: (0, 2), T.Q5_0: (0,), T.Q5_1: (0, 2), T.Q8_0: (0,), T.Q4_K: (0, 2),
                T.Q5_K: (0, 2), T.Q6_K: (208,)}


@pytest.mark.parametrize("ggml_type", [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K,
                                       T.F16, T.BF16, T.F32], ids=lambda t: t.name)
def test_random_blocks_decode_as_shared_dequant(lib, ggml_type):
    rng = np.random.default_rng(int(ggml_type))
    block, size = GGML_QUANT_SIZES[ggml_type]
    n_blocks = 4096 // block * 8
    raw = rng.integers(0, 256, (n_blocks, size), dtype=np.uint8)
    for off in _HALF_FIELDS.get(ggml_type, ()):
        raw[:, off:off + 2] = (rng.standard_normal(n_blocks) * 0.05).astype(np.float16).view(np.uint8).reshape(-1, 2)
    raw = raw.reshape(-1)
    _same_bits(_decode(lib, ggml_type, raw), dequantize(raw, ggml_type, (n_blocks, block)).reshape(-1))


def test_half_to_float_every_half(lib):
    halves = np.arange(1 << 16, dtype=np.uint16)
    out = np.empty(halves.size, np.float32)
    lib.ts_halves_to_floats(halves, halves.size, out)
    _same_bits(out, halves.view(np.float16).astype(np.float32))


def test_float_to_half_rounds_as_numpy(lib):
    rng = np.random.default_rng(1)
    bits = rng.integers(0, 1 << 32, 1 << 20, dtype=np.uint64).astype(np.uint32)
    edges = np.array([0.0, -0.0, 65504.0, 65519.99, 65520.0, 1e-8, 2.98e-8, 2.9802322e-8, 5.96e-8, 6.1e-5,
                      6.097555e-05, 1.0 + 2 ** -11, 1.0 + 3 * 2 ** -11, np.inf, -np.inf], np.float32)
    x = np.concatenate([bits.view(np.float32), edges, (rng.standard_normal(1 << 16) * 4).astype(np.float32),
                        # exactly halfway between two halves, both parities, normal and subnormal
                        (np.arange(1, 4096, dtype=np.float32) + 0.5) * np.float32(2 ** -24),
                        (np.arange(1024, 2048, dtype=np.float32) + 0.5) * np.float32(2 ** -10)])
    out = np.empty(x.size, np.uint16)
    lib.ts_floats_to_halves(x, x.size, out)
    with np.errstate(over="ignore"):
        ref = x.astype(np.float16).view(np.uint16)
    nan = np.isnan(x)
    np.testing.assert_array_equal(out[~nan], ref[~nan])
    assert np.isnan(out[nan].view(np.float16)).all()


def _kv_rows(head_dim: int) -> np.ndarray:
    rng = np.random.default_rng(7)
    rows = [rng.standard_normal((256, head_dim)) * 2,
            rng.integers(-16, 17, (64, head_dim)) / 4.0,      # many values exactly on a rounding tie
            np.zeros((2, head_dim)),
            rng.standard_normal((32, head_dim)) * 1e-6, rng.standard_normal((32, head_dim)) * 3e4]
    return np.ascontiguousarray(np.concatenate(rows), np.float32)


@pytest.mark.parametrize("codec", ["f16", "q8_0", "q4_0"])
@pytest.mark.parametrize("head_dim", [64, 256])
def test_kv_codecs_match_the_cpu_pool(lib, codec, head_dim):
    from kernels.cpu import kv_codecs
    if not kv_codecs.available():
        pytest.skip("numba is missing: kernels/cpu/kv_codecs.py has no compiled codecs to compare with")
    x = _kv_rows(head_dim)
    n = x.shape[0]
    pool = np.zeros(kv_codecs.pool_shape(codec, 1, n, 1, head_dim), kv_codecs.DTYPES[kv_codecs.number(codec)])
    kv_codecs.store(pool, pool.copy(), x[:, None, :], x[:, None, :], np.arange(n, dtype=np.int64))
    ref_bytes = kv_codecs.raw(pool).reshape(n, -1)
    ours = np.empty_like(ref_bytes)
    number = kv_codecs.number(codec)
    lib.ts_kv_encode(number, x, n, head_dim, ours)
    np.testing.assert_array_equal(ours, ref_bytes)
    decoded = np.empty((n, head_dim), np.float32)
    lib.ts_kv_decode(number, np.ascontiguousarray(ref_bytes), n, head_dim, decoded)
    _same_bits(decoded, kv_codecs.gather(pool, np.zeros(1, np.int64), n)[0])


def test_rope_pair_rotation_as_numpy(lib):
    rng = np.random.default_rng(3)
    x0, x1 = (rng.standard_normal(1 << 16).astype(np.float32) for _ in range(2))
    angles = rng.uniform(0, 4096, 1 << 16)
    c, s = np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
    r0, r1 = np.empty_like(x0), np.empty_like(x0)
    lib.ts_rope_pairs(x0, x1, c, s, x0.size, r0, r1)
    _same_bits(r0, x0 * c - x1 * s)         # numpy rounds each product and the sum: so does the kernel
    _same_bits(r1, x0 * s + x1 * c)


@pytest.mark.parametrize("parts", [1, 4, 8])
@pytest.mark.parametrize("n", [1, 3, 100, 2049])
def test_online_softmax_merge(lib, parts, n):
    rng = np.random.default_rng(n * parts)
    scores = (rng.standard_normal(n) * 8).astype(np.float32)
    values = rng.standard_normal(n).astype(np.float32)
    out = ctypes.c_float()
    lib.ts_softmax_weighted(scores, values, n, parts, ctypes.byref(out))
    w = np.exp(scores.astype(np.float64) - scores.max())
    assert out.value == pytest.approx(float((w / w.sum()) @ values), rel=1e-5, abs=1e-6)


def test_uniform_is_splitmix64(lib):
    mask = (1 << 64) - 1

    def reference(seed: int, counter: int) -> float:
        z = (seed + (counter + 1) * 0x9E3779B97F4A7C15) & mask
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
        z ^= z >> 31
        return (z >> 11) / float(1 << 53)
    counters = np.arange(1000, dtype=np.uint64)
    out = np.empty(counters.size)
    seed = 0xDEADBEEF12345678
    lib.ts_uniforms(seed, counters, counters.size, out)
    assert out.tolist() == [reference(seed, int(c)) for c in counters]
    assert 0.45 < out.mean() < 0.55 and out.min() >= 0.0 and out.max() < 1.0
