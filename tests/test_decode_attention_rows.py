"""decode_attention.attend_rows, the attention of a verification chunk's rows (positions of one
sequence, one block table) that decodes each block's keys and values once for all of them: every
row's result bit-identical to decode_attention.attend's for that row alone (the replay takes
either, and a speculative verification must give the tokens a plain decode gives), for every
codec, windows whose edges fall inside blocks, heads split between calls, and 1-8 rows."""
import numpy as np
import pytest

from kernels.cpu import decode_attention, kv_codecs
from test_flash_attention import make_cache

pytestmark = pytest.mark.skipif(not decode_attention.available(), reason="needs numba")


@pytest.mark.parametrize("codec", ["f16", "q8_0", "q4_0"])
@pytest.mark.parametrize("n_kv,heads,dim,block_size,window,depth", [
    (3, 9, 64, 16, 0, 300),      # SmolLM2's shape
    (3, 9, 64, 16, 0, 17),       # rows within the first blocks
    (1, 4, 256, 16, 512, 700),   # Gemma 3's windowed layers, the window past the start
    (1, 4, 256, 16, 0, 123),
    (2, 4, 32, 32, 37, 200),     # a window whose edge never meets a block edge
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
                                        b, kv, g0, g1, True)
            decode_attention.attend_rows(q, k, v, number, table, ctx, np.float32(0.125), window, half, together,
                                         0, rows, kv, g0, g1, True)
            np.testing.assert_array_equal(together, alone)
            if rows > 2:                             # a share of the rows, as a thread takes it
                part = together.copy()
                decode_attention.attend_rows(q, k, v, number, table, ctx, np.float32(0.125), window, half, part,
                                             1, rows - 1, kv, g0, g1, True)
                np.testing.assert_array_equal(part, alone)
    assert not np.isnan(alone).any()
