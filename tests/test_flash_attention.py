"""The tiled online-softmax attention of causal rows (kernels/cpu/flash_attention.py) against a
float64 softmax over the same cache: every codec, windows whose edges fall inside blocks, block
sizes other than 16, and each row's result independent of the rows computed with it."""
import numpy as np
import pytest

from kernels.cpu import flash_attention, kv_codecs

pytestmark = pytest.mark.skipif(not flash_attention.available(), reason="needs numba")


def make_cache(rng, codec, n_kv, n_blocks, block_size, dim):
    k = np.zeros(kv_codecs.pool_shape(codec, n_blocks, block_size, n_kv, dim), kv_codecs.DTYPES[kv_codecs.number(codec)])
    v = np.zeros_like(k)
    slots = np.arange(n_blocks * block_size)
    kv_codecs.store(k, v, rng.standard_normal((len(slots), n_kv, dim)).astype(np.float32),
                    rng.standard_normal((len(slots), n_kv, dim)).astype(np.float32), slots)
    return k, v


def reference(q, k, v, table, ctx, scale, window):
    """float64 softmax(scale q K^T) V of each row over the keys it sees, from the decoded cache."""
    n_kv = k.shape[0]
    keys = kv_codecs.gather(k, table, int(ctx.max())).astype(np.float64)
    values = kv_codecs.gather(v, table, int(ctx.max())).astype(np.float64)
    group = q.shape[1] // n_kv
    out = np.empty(q.shape)
    for r, n in enumerate(ctx):
        lo = max(0, n - window) if window else 0
        for h in range(q.shape[1]):
            s = keys[h // group, lo:n] @ q[r, h].astype(np.float64) * scale
            p = np.exp(s - s.max())
            out[r, h] = p @ values[h // group, lo:n] / p.sum()
    return out


# the softmax weights are rounded to float16 (ggml's CPU backend takes them so): ~2**-11 each
@pytest.mark.parametrize("codec,tolerance", [("f16", 1e-3), ("q8_0", 1e-3), ("q4_0", 1e-3)])
@pytest.mark.parametrize("n_kv,heads,dim,block_size,window", [
    (3, 9, 64, 16, 0),          # SmolLM2's shape
    (1, 4, 256, 16, 512),       # Gemma 3's windowed layers
    (1, 4, 256, 16, 0),
    (2, 4, 32, 32, 37),         # a window whose edge never meets a block edge
    (2, 6, 32, 128, 100),       # blocks larger than a key tile
])
def test_rows_match_a_float64_softmax(codec, tolerance, n_kv, heads, dim, block_size, window):
    rng = np.random.default_rng(7)
    depth, rows = 700, 45
    n_blocks = -(-depth // block_size) + 2
    k, v = make_cache(rng, codec, n_kv, n_blocks, block_size, dim)
    table = rng.permutation(n_blocks).astype(np.int64)          # blocks in no order
    q = rng.standard_normal((rows, heads, dim)).astype(np.float32)
    ctx = np.arange(depth - rows + 1, depth + 1, dtype=np.int64)
    got = flash_attention.attention(q, k, v, np.repeat(table[None], rows, 0), ctx, 0.1, window,
                                    sequences=np.zeros(rows, np.int64))
    np.testing.assert_allclose(got, reference(q, k, v, table, ctx, 0.1, window), atol=tolerance, rtol=0)


@pytest.mark.parametrize("window", [0, 40])
def test_a_rows_result_does_not_depend_on_its_tile_or_batch(window):
    """Each row computed alone, in its chunk, and packed after another sequence's rows: the same bits."""
    rng = np.random.default_rng(3)
    n_kv, heads, dim, bs = 2, 6, 64, 16
    k, v = make_cache(rng, "f16", n_kv, 80, bs, dim)
    table_a, table_b = np.arange(40, dtype=np.int64), np.arange(40, 80, dtype=np.int64)
    table_b[0] = 0                                              # a prefix block the two sequences share
    q = rng.standard_normal((60, heads, dim)).astype(np.float32)
    ctx = np.concatenate([np.arange(300, 330), np.arange(331, 361)]).astype(np.int64)   # B starts at A's end + 1
    tables = np.concatenate([np.repeat(table_a[None], 30, 0), np.repeat(table_b[None], 30, 0)])
    sequences = np.repeat([0, 1], 30)
    packed = flash_attention.attention(q, k, v, tables, ctx, 0.125, window, sequences=sequences)
    for r in range(60):
        alone = flash_attention.attention(q[r:r + 1], k, v, tables[r:r + 1], ctx[r:r + 1], 0.125, window,
                                          parallel=False)
        np.testing.assert_array_equal(alone[0], packed[r])
    for lo, hi in ((0, 7), (7, 30), (30, 31), (31, 60)):      # other chunkings of the same rows
        part = flash_attention.attention(q[lo:hi], k, v, tables[lo:hi], ctx[lo:hi], 0.125, window,
                                         sequences=sequences[lo:hi])
        np.testing.assert_array_equal(part, packed[lo:hi])
    b_alone = reference(q[30:], k, v, table_b, ctx[30:], 0.125, window)   # B's rows read B's blocks
    np.testing.assert_allclose(packed[30:], b_alone, atol=1e-3, rtol=0)


def test_row_tiles_split_sequences_and_gaps():
    seqs = np.array([0] * 20 + [1, 1, 2])
    ctx = np.array(list(range(5, 25)) + [25, 27, 28])
    starts = flash_attention.row_tiles(seqs, ctx)
    assert starts.tolist() == [0, flash_attention.ROW_TILE, 20, 21, 22, 23]
