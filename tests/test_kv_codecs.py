"""The KV pool's codecs (kernels/cpu/kv_codecs.py): f16, and q8_0 / q4_0 coded in place with
ggml's reference formulas, read directly by attention, exported and imported as their bytes."""
from types import SimpleNamespace

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType

from kernels.cpu import CPUBackend, kv_codecs
from test_kernels import Paged, close, stored

pytestmark = pytest.mark.skipif(not kv_codecs.available(), reason="needs numba")

QTYPES = {"q8_0": GGMLQuantizationType.Q8_0, "q4_0": GGMLQuantizationType.Q4_0}


def rows_with_edge_cases(n: int, dim: int, seed: int) -> np.ndarray:
    """K/V-like rows over many magnitudes, with an all-zero block, ties of Q8_0's rounding and a
    block whose largest magnitude is negative and one where it is positive (Q4_0's scale sign)."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((n, dim)) * 10.0 ** rng.integers(-4, 3, (n, 1))).astype(np.float32)
    x[0, :32] = 0.0
    x[1, :32] = np.float32(127.0) * np.arange(-16, 16, dtype=np.float32) / 32   # codes on .5 ties
    x[1, 0] = -127.0
    x[2, 5], x[3, 7] = -1000.0, 1000.0
    return x


@pytest.mark.parametrize("codec", ["q8_0", "q4_0"])
def test_quantized_rows_are_ggmls_bytes(codec):
    """The pool's bytes of a quantized codec are what gguf's numpy port of ggml's
    quantize_row_q8_0_ref / q4_0_ref writes, and reading them back gives its dequantization."""
    ops = CPUBackend()
    n, dim = 64, 64
    x = rows_with_edge_cases(n, dim, 1)
    k_cache, v_cache = ops.alloc_kv(8, 16, 2, dim, codec)
    assert k_cache.dtype == kv_codecs.DTYPES[kv_codecs.number(codec)] and k_cache.shape == (2, 8, 16, dim // 32)
    rows = x.reshape(n // 2, 2, dim)                    # [tokens, kv heads, head_dim]
    slots = np.random.default_rng(2).permutation(128)[:n // 2]
    ops.store_kv(k_cache, v_cache, rows, -rows, slots)
    want = gguf.quants.quantize(x, QTYPES[codec])       # [n, row bytes]
    got = kv_codecs.raw(k_cache).reshape(2, 128, -1)[:, slots].transpose(1, 0, 2).reshape(n, -1)
    np.testing.assert_array_equal(got, want)
    decoded = kv_codecs.gather(k_cache, np.arange(8), 128)[:, slots].transpose(1, 0, 2).reshape(n, dim)
    np.testing.assert_array_equal(decoded, gguf.quants.dequantize(want, QTYPES[codec]))


def test_f16_rows_are_numpys_float16():
    ops = CPUBackend()
    x = rows_with_edge_cases(32, 64, 3).reshape(16, 2, 64)
    k_cache, v_cache = ops.alloc_kv(2, 16, 2, 64)
    ops.store_kv(k_cache, v_cache, x, x, np.arange(16))
    np.testing.assert_array_equal(k_cache[:, 0], x.transpose(1, 0, 2).astype(np.float16))
    np.testing.assert_array_equal(kv_codecs.gather(k_cache, np.array([0]), 16), stored(x, "f16").transpose(1, 0, 2))


def test_row_bytes_and_head_dims():
    assert [kv_codecs.row_bytes(c, 64) for c in kv_codecs.NAMES] == [128, 68, 36]
    assert [kv_codecs.row_bytes(c, 256) for c in kv_codecs.NAMES] == [512, 272, 144]
    kv_codecs.check_head_dim("f16", 48)
    with pytest.raises(ValueError, match="multiple of 32"):
        kv_codecs.row_bytes("q8_0", 48)
    with pytest.raises(ValueError, match="unknown KV cache dtype"):
        kv_codecs.number("q2_k")


BACKENDS = {
    "compiled": lambda: CPUBackend(),                                     # decode rows in numba, prompts on OpenBLAS
    "float": lambda: CPUBackend(quantized_matmul=False),                  # no compiled passes at all
}


@pytest.mark.parametrize("codec", ["q8_0", "q4_0", "f16"])
@pytest.mark.parametrize("backend", sorted(BACKENDS))
@pytest.mark.parametrize("window", [0, 7])
def test_attention_over_coded_blocks_is_attention_over_their_values(codec, backend, window):
    """Decode rows (the compiled kernel, dequantizing one block at a time), prompt chunks (OpenBLAS
    over the context decoded once) and a mixed batch, through shuffled block tables: the attention
    of the values the blocks dequantize to."""
    ops = BACKENDS[backend]()
    seqs = [(17, 1), (40, 9), (1, 1), (23, 5), (50, 1), (150, 140)]
    Paged(ops, seqs, n_heads=6, n_kv=2, dim=64, block_size=16, seed=8, codec=codec).check(scale=0.125, window=window)


def exactly_coded(codec: str, shape: tuple[int, ...], rng) -> np.ndarray:
    """Rows that `codec` holds exactly: each block of 32 a power-of-two scale times codes whose extreme
    sets that scale (Q8_0: 127, Q4_0: -8), so the dequantized values equal them and float16 holds them."""
    lo, hi, extreme = (-127, 128, 127) if codec == "q8_0" else (-7, 8, -8)
    codes = rng.integers(lo, hi, shape).astype(np.float32)
    codes[..., ::32] = extreme
    scale = 2.0 ** rng.integers(-12, -2, shape[:-1] + (shape[-1] // 32, 1))
    return (codes.reshape(shape[:-1] + (-1, 32)) * scale).reshape(shape).astype(np.float32)


@pytest.mark.parametrize("codec", ["q8_0", "q4_0"])
def test_rowwise_attention_reads_quantized_blocks_as_their_values(codec):
    """The 8-bit passes' attention (every causal row alone, float16 queries and softmax), parallel and
    serial, over quantized blocks gives bit for bit what it gives over an f16 pool of the same values."""
    from kernels.cpu import decode_attention
    rng = np.random.default_rng(4)
    n_kv, dim, bs, n_blocks = 2, 64, 16, 12
    ops = CPUBackend()
    x = exactly_coded(codec, (2, n_blocks * bs, n_kv, dim), rng)
    pools = []
    for name in (codec, "f16"):
        k_cache, v_cache = ops.alloc_kv(n_blocks, bs, n_kv, dim, name)
        ops.store_kv(k_cache, v_cache, x[0], x[1], np.arange(n_blocks * bs))
        pools.append((k_cache, v_cache))
    np.testing.assert_array_equal(kv_codecs.gather(pools[0][0], np.arange(n_blocks), n_blocks * bs),
                                  x[0].transpose(1, 0, 2))
    tables = rng.permutation(n_blocks).reshape(2, 6).astype(np.int64)
    ctx = np.array([70, 93], np.int64)
    q = decode_attention.half_queries(rng.standard_normal((2, 6, dim)).astype(np.float32))
    for parallel in (True, False):
        got, want = (decode_attention.decode_attention(q, k, v, tables, ctx, 0.125, 0, parallel, True)
                     for k, v in pools)
        assert np.all(np.isfinite(got))
        np.testing.assert_array_equal(got, want)


def small_pool(codec: str, num_blocks: int = 6):
    from worker.kv_pool import KVCapacity, KVPool
    config = SimpleNamespace(n_layers=3, n_kv_heads=2, head_dim=64)
    return KVPool(config, KVCapacity(num_blocks, 16, num_blocks * 16), CPUBackend(), codec)


@pytest.mark.parametrize("codec", ["f16", "q8_0", "q4_0"])
def test_blocks_export_and_import_as_their_own_bytes(codec):
    """ExportBlocks gives the blocks block-major in the codec's layout (float16 values, or the ggml
    blocks' bytes): block i's slice is the block format's payload, carried whole; ImportBlocks of
    the stored payloads into another pool restores every byte."""
    from scheduler.block_format import Geometry, KVBlock, decode, encode
    from scheduler.block_manager import block_hash
    from worker import block_transfer
    rng = np.random.default_rng(5)
    source, target = small_pool(codec), small_pool(codec, 9)
    for k_cache, v_cache in source.caches:
        x = (rng.standard_normal((2, 96, 2, 64))).astype(np.float32)
        source.ops.store_kv(k_cache, v_cache, x[0], x[1], np.arange(96))
    kv = block_transfer.export_blocks(source, [4, 1])
    width = 64 if codec == "f16" else kv_codecs.row_bytes(codec, 64)
    assert kv.shape == (2, 3, 2, 2, 16, width) == block_transfer.packed_shape(source, 2)
    assert kv.dtype == (np.float16 if codec == "f16" else np.uint8)
    assert block_transfer.pool_dtype_name(source) == codec

    geometry = Geometry("fp", codec, 16, 3, 2, 64)
    assert geometry.payload_bytes == 3 * 2 * 2 * 16 * kv_codecs.row_bytes(codec, 64) == kv[0].nbytes
    values = []
    for i, tokens in enumerate((tuple(range(16)), tuple(range(16, 32)))):
        values.append(encode(KVBlock(geometry, block_hash(b"fp", None, tokens), None, tokens, kv[i].tobytes())))
    restored = [decode(v, geometry) for v in values]
    packed = np.frombuffer(b"".join(bytes(b.payload) for b in restored), kv.dtype).reshape(kv.shape)
    block_transfer.import_blocks(target, [7, 2], packed)
    for (k_src, v_src), (k_dst, v_dst) in zip(source.caches, target.caches):
        for src, dst in ((4, 7), (1, 2)):
            np.testing.assert_array_equal(kv_codecs.raw(k_dst[:, dst]), kv_codecs.raw(k_src[:, src]))
            np.testing.assert_array_equal(kv_codecs.raw(v_dst[:, dst]), kv_codecs.raw(v_src[:, src]))


@pytest.mark.parametrize("codec", ["f16", "q8_0", "q4_0"])
def test_blocks_with_a_value_or_scale_not_finite_are_refused(codec):
    from scheduler.block_format import BlockRejected, Geometry, KVBlock, decode, encode, holds_nonfinite
    from scheduler.block_manager import block_hash
    from worker import block_transfer
    pool = small_pool(codec)
    kv = block_transfer.export_blocks(pool, [0])
    bad = kv.copy()
    at = 6 if codec == "f16" else kv_codecs.DTYPES[kv_codecs.number(codec)].itemsize   # a value / a row's 2nd scale
    bad.view(np.uint8)[0, 1, 0, 0, 3, at:at + 2] = np.frombuffer(np.float16(np.nan).tobytes(), np.uint8)
    before = [kv_codecs.raw(k[:, 2]).copy() for k, _ in pool.caches]
    with pytest.raises(block_transfer.BlockTransferError, match="NaN"):
        block_transfer.import_blocks(pool, [2], bad)
    assert all(np.array_equal(kv_codecs.raw(k[:, 2]), b) for (k, _), b in zip(pool.caches, before))  # nothing written
    with pytest.raises(block_transfer.BlockTransferError, match="dtype"):
        block_transfer.import_blocks(pool, [2], kv.astype(np.float32 if codec == "f16" else np.int8))
    geometry = Geometry("fp", codec, 16, 3, 2, 64)
    tokens = tuple(range(16))
    value = encode(KVBlock(geometry, block_hash(b"fp", None, tokens), None, tokens, bad[0].tobytes()))
    assert holds_nonfinite(decode(value, geometry))
    assert not holds_nonfinite(decode(encode(KVBlock(geometry, block_hash(b"fp", None, tokens), None, tokens,
                                                     kv[0].tobytes())), geometry))
    with pytest.raises(BlockRejected, match="codec"):
        decode(value, Geometry("fp", "f16" if codec != "f16" else "q8_0", 16, 3, 2, 64))


def test_bytes_per_block_counts_the_codecs_bytes():
    from worker.kv_pool import bytes_per_block
    config = SimpleNamespace(n_layers=30, n_kv_heads=3, head_dim=64)           # SmolLM2-135M
    sizes = {c: bytes_per_block(config, 16, c) for c in kv_codecs.NAMES}
    assert sizes == {"f16": 368640, "q8_0": 195840, "q4_0": 103680}
    close(sizes["f16"] / sizes["q8_0"], 64 / 34)


@pytest.mark.parametrize("codec", ["q8_0", "q4_0"])
@pytest.mark.parametrize("model", ["smollm2-135m", "gemma3-270m"])
def test_replayed_decode_over_quantized_blocks_equals_the_kernels(model, codec, engines):
    """The captured-graph replay codes K/V into the quantized pool and attends over it as the kernels
    do: the same logits and the same bytes in the pool, bit for bit, over several steps."""
    from conftest import load_fixture
    from test_graph_replay import decode_chunks, kv_rows, prefill
    runner = engines(model, codec).runner
    ops = runner.ops
    if not ops.int8_matmul:
        pytest.skip("the model's products are not in 8-bit integers here")
    prompts = [c["prompt_tokens"] for c in load_fixture(model)["generate"][:2]]
    tables = [prefill(runner, 700 + i, p, 1 + 60 * i) for i, p in enumerate(prompts)]
    sequences = [(700 + i, p, t, 1000 + 7 * i) for i, (p, t) in enumerate(zip(prompts, tables))]
    for step in range(3):
        ops.graph_replay = True
        replayed = runner.forward_logits(decode_chunks(sequences, step))
        replayed_kv = [kv_codecs.raw(c) for _, p, t, _ in sequences for c in kv_rows(runner, t, len(p) + step, 1)]
        assert any(r is not None for r in ops._replays.values()), "the pass was not replayed"
        ops.graph_replay = False
        plain = runner.forward_logits(decode_chunks(sequences, step))      # rewrites the same K/V
        ops.graph_replay = True
        np.testing.assert_array_equal(replayed, plain)
        plain_kv = [kv_codecs.raw(c) for _, p, t, _ in sequences for c in kv_rows(runner, t, len(p) + step, 1)]
        for got, want in zip(replayed_kv, plain_kv):
            np.testing.assert_array_equal(got, want)
