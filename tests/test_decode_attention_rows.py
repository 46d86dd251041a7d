"""row_tile_attention.attend_rows, the attention of a verification chunk's rows (positions of one
sequence, one block table) that decodes each block's keys and values once for all of them: every
row's result bit-identical to decode_attention.attend's for that row alone (the replay takes
either, and a speculative verification must give the tokens a plain decode gives), for every
codec, windows whose edges fall inside blocks, heads split between calls, and 1-8 rows; and rows
long enough to take their keys in two parts (key_parts.split_point) against a float64
softmax."""
import numpy as np
import pytest

from kernels.cpu import decode_attention, key_parts, kv_codecs, row_tile_attention
from test_flash_attention import make_cache, reference

pytestmark = pytest.mark.skipif(not decode_attention.available(), reason="needs numba")


@pytest.mark.parametrize("codec", ["f16", "q8_0", "q4_0"])
@pytest.mark.parametrize("n_kv,heads,dim,block_size,window,depth", [
    (3, 9, 64, 16, 0, 300),      # SmolLM2's shape
    (3, 9, 64, 16, 0, 17),       # rows within the first blocks
    (1, 4, 256, 16, 512, 700),   # Gemma 3's windowed layers, the window past the start
    (1, 4, 256, 16, 0, 123),
    (2, 4, 32, 32, 37, 200),     # a window whose edge never meets a block edge
    (1, 4, 256, 16, 0, 4100),    # rows on both sides of SPLIT_KEYS: one part, then two
    (3, 9, 64, 16, 4099, 4200),  # a window of two parts whose start falls inside a block
    (3, 9, 64, 8, 0, 150),       # blocks of fewer keys than a vector: scores a key at a time
])
@pytest.mark.parametrize("rows", [1, 3, 6, 8])
@pytest.mark.parametrize("half", [True, False])
def test_each_row_is_what_attend_gives_it_alone(codec, n_kv, heads, dim, block_size, window, depth, rows, half):
    rng = np.random.default_rng(depth + rows)
    n_blocks = -(-depth // block_size) + 1
    k_pool, v_pool = make_cache(rng, codec, n_kv, n_blocks, block_size, dim)
    k, v, number = kv_codecs.raw(k_pool), kv_codecs.raw(v_pool), kv_codecs.codec_of(k_pool)
    table = rng.permutation(n_blocks).astype(np.int64)
    q = rng.standard_normal((rows, heads, dim)).astype(np.float32)
    ctx = np.arange(depth - rows + 1, depth + 1, dtype=np.int64)
    group = heads // n_kv
    alone, together = np.full(q.shape, np.nan, np.float32), np.full(q.shape, np.nan, np.float32)
    for kv in range(n_kv):
        for g0, g1 in ((0, group), (0, 1), (1, group)) if group > 1 else ((0, 1),):
            for b in range(rows):
                decode_attention.attend(q, k, v, number, table, ctx[b], np.float32(0.125), window, half, alone,
                                        b, kv, g0, g1)
            row_tile_attention.attend_rows(q, k, v, number, table, ctx, np.float32(0.125), window, half, together,
                                         0, rows, kv, g0, g1)
            np.testing.assert_array_equal(together, alone)
            if rows > 2:                             # a share of the rows, as a thread takes it
                part = together.copy()
                row_tile_attention.attend_rows(q, k, v, number, table, ctx, np.float32(0.125), window, half, part,
                                             1, rows - 1, kv, g0, g1)
                np.testing.assert_array_equal(part, alone)
    assert not np.isnan(alone).any()


@pytest.mark.parametrize("half", [True, False])
@pytest.mark.parametrize("window", [0, 4500])
def test_rows_in_two_parts_match_a_float64_softmax(half, window):
    """Rows from one key short of SPLIT_KEYS to past it: the merged parts are the softmax over all
    keys (a scale that makes one part's maximum dominate, so the merge's rescaling matters)."""
    rng = np.random.default_rng(3)
    depth, rows, block_size = 5000, 8, 16
    ctx = np.array([key_parts.SPLIT_KEYS - 1, key_parts.SPLIT_KEYS, 4111, 4500, 4600, 4801, 4999,
                    5000], np.int64)
    n_blocks = -(-depth // block_size) + 1
    k_pool, v_pool = make_cache(rng, "f16", 1, n_blocks, block_size, 256)
    k, v, number = kv_codecs.raw(k_pool), kv_codecs.raw(v_pool), kv_codecs.codec_of(k_pool)
    table = rng.permutation(n_blocks).astype(np.int64)
    q = rng.standard_normal((rows, 4, 256)).astype(np.float32)
    out = np.full(q.shape, np.nan, np.float32)
    for b in range(rows):
        assert (key_parts.split_point(int(ctx[b]), window, block_size) >= 0) == (b > 0)
        decode_attention.attend(q, k, v, number, table, ctx[b], np.float32(0.3), window, half, out, b, 0, 0, 4)
    np.testing.assert_allclose(out, reference(q, k_pool, v_pool, table, ctx, 0.3, window), atol=1e-3 if half else 1e-5, rtol=0)


@pytest.mark.parametrize("parallel", [True, False])
def test_prompt_rows_in_tiles_are_each_rows_own(parallel):
    """decode_attention with `sequences` (a prompt chunk's rows taken ROW_TILE at a time by
    attend_rows) gives every row what it gets alone, bit for bit: two sequences' chunks packed
    together, one of them crossing SPLIT_KEYS, beside single decode rows."""
    rng = np.random.default_rng(9)
    block_size, n_blocks = 16, 600
    k_pool, v_pool = make_cache(rng, "f16", 3, n_blocks, block_size, 64)
    first = np.arange(300, dtype=np.int64)
    second = np.arange(300, 600, dtype=np.int64)[rng.permutation(300)]
    ctx = np.concatenate([np.arange(key_parts.SPLIT_KEYS - 20, key_parts.SPLIT_KEYS + 30), [77],
                          np.arange(100, 137), [4500]]).astype(np.int64)
    sequences = np.array([0] * 50 + [1] + [2] * 37 + [3])
    tables = np.stack([first if s in (0, 3) else second for s in sequences])
    q = decode_attention.half_queries(rng.standard_normal((len(ctx), 9, 64)).astype(np.float32))
    tiled = decode_attention.decode_attention(q, k_pool, v_pool, tables, ctx, 0.125, 0, parallel, True,
                                              sequences=sequences)
    alone = decode_attention.decode_attention(q, k_pool, v_pool, tables, ctx, 0.125, 0, parallel, True)
    assert len(decode_attention.row_tiles(sequences, ctx, decode_attention.ROW_TILE)) - 1 == 4 + 1 + 3 + 1
    np.testing.assert_array_equal(tiled, alone)
