"""The CPU kernels of the text-diffusion step: the row-invariant float32 product (each output row
bit-identical whatever rows share the call), the head's statistics computed without writing the
logits out, the compiled non-causal attention, and the samplers' draws from those statistics
against the same draws from whole logits (worker/diffusion/base.py)."""
from __future__ import annotations

import numpy as np
import pytest

from kernels.cpu import attention, elementwise, logit_stats, row_matmul
from shared.diffusion_params import DiffusionParams
from worker.diffusion import DiffusionRandom, sampler_for
from worker.diffusion.base import draw_positions, draws_from_stats, stats_needed

pytestmark = pytest.mark.skipif(not (row_matmul.available() and logit_stats.available()),
                                reason="the compiled kernels need numba and FMA")


@pytest.mark.parametrize("k_in,n_out", [(64, 49153), (64, 192), (192, 64), (7, 5), (64, 32)])
def test_row_matmul_rows_are_bit_identical_whatever_shares_the_call(k_in, n_out):
    rng = np.random.default_rng(k_in * 1000 + n_out)
    w = rng.standard_normal((k_in, n_out)).astype(np.float32)
    tiles = row_matmul.from_dense(w)
    x = rng.standard_normal((150, k_in)).astype(np.float32)     # > ROW_CHUNK: several chunks a tile
    full = row_matmul.matmul(x, tiles)
    assert full.shape == (150, n_out) and full.flags.c_contiguous
    np.testing.assert_allclose(full, x.astype(np.float64) @ w.astype(np.float64), atol=1e-4, rtol=1e-5)
    for trial in range(12):
        rows = rng.choice(150, size=int(rng.integers(1, 150)), replace=False)
        assert np.array_equal(row_matmul.matmul(x[rows], tiles), full[rows]), trial
    for r in range(9):                                           # alone, one row a call
        assert np.array_equal(row_matmul.matmul(x[r:r + 1], tiles), full[r:r + 1])


def test_head_stats_match_the_logits_and_are_row_invariant():
    rng = np.random.default_rng(3)
    w = (0.4 * rng.standard_normal((64, 4100))).astype(np.float32)     # several chunks, a partial last tile
    w[:, 4099] = w[:, 17]                                               # a tie across chunks: the first wins
    tiles = row_matmul.from_dense(w)
    x = rng.standard_normal((40, 64)).astype(np.float32)
    logits = row_matmul.matmul(x, tiles)
    argmax, top, second_exp, sums, moments = logit_stats.head_stats(x, tiles, True, True, True)
    assert np.array_equal(argmax, np.argmax(logits, axis=1))
    assert np.array_equal(top, logits.max(axis=1))
    l64 = logits.astype(np.float64) - top[:, None]
    e = np.exp(l64)
    np.testing.assert_allclose(sums, e.sum(axis=1), rtol=1e-6)
    np.testing.assert_allclose(moments, (e * l64).sum(axis=1), rtol=1e-5, atol=1e-6)
    runner_up = np.sort(logits, axis=1)[:, -2].astype(np.float64)
    np.testing.assert_allclose(second_exp, np.exp(runner_up - top), rtol=1e-6)
    # the separate pass over written-out logits agrees
    r_arg, r_top, _, r_sums, _ = logit_stats.row_stats(logits, None, True, False, False)
    assert np.array_equal(r_arg, argmax) and np.array_equal(r_top, top)
    np.testing.assert_allclose(r_sums, sums, rtol=1e-6)
    for rows in ([5], [39, 0, 7], list(range(1, 40, 3))):
        again = logit_stats.head_stats(x[rows], tiles, True, True, True)
        assert all(np.array_equal(a, b[rows]) for a, b in zip(again, (argmax, top, second_exp, sums, moments)))


@pytest.mark.parametrize("algorithm", ["confidence", "margin", "entropy", "random", "origin", "low_confidence",
                                       "entropy_bound"])
@pytest.mark.parametrize("top_k", [0, 1])
def test_draws_from_statistics_are_the_draws_from_logits(algorithm, top_k):
    rng = np.random.default_rng(11)
    logits = (3 * rng.standard_normal((12, 3000))).astype(np.float32)
    params = DiffusionParams(algorithm=algorithm, top_k=top_k, seed=4, threshold=0.001, gamma=20.0)
    stats = logit_stats.row_stats(logits, None, *stats_needed(params))
    fast, slow = draws_from_stats(*stats, params), draw_positions(logits, params, DiffusionRandom(4))
    assert np.array_equal(fast.tokens, slow.tokens)
    needs = stats_needed(params)
    if needs[0] or top_k == 1:
        np.testing.assert_allclose(fast.probability, slow.probability, rtol=1e-5)
    if needs[1] or top_k == 1:
        np.testing.assert_allclose(fast.margin, slow.margin, rtol=1e-4, atol=1e-7)
    if needs[2] or top_k == 1:
        np.testing.assert_allclose(fast.entropy, slow.entropy, rtol=1e-4, atol=1e-6)
    sampler = sampler_for(algorithm)
    a = sampler.commit_draws(fast, 5, params, DiffusionRandom(4))
    b = sampler.commit(logits, 5, params, DiffusionRandom(4))
    assert np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1])


@pytest.mark.skipif(not elementwise.available(), reason="needs numba")
def test_compiled_dense_attention_is_each_sequence_alone():
    rng = np.random.default_rng(5)
    lens = np.array([21, 37, 5, 64])
    n = int(lens.sum())
    q = rng.standard_normal((n, 4, 16)).astype(np.float32)
    k = rng.standard_normal((n, 2, 16)).astype(np.float32)
    v = rng.standard_normal((n, 2, 16)).astype(np.float32)
    out = attention.dense_attention(q, k, v, lens, 0.25)
    start = 0
    for length in lens.tolist():
        s = slice(start, start + length)
        for h in range(4):
            scores = (q[s, h].astype(np.float64) @ k[s, h // 2].T.astype(np.float64)) * 0.25
            p = np.exp(scores - scores.max(axis=1, keepdims=True))
            p /= p.sum(axis=1, keepdims=True)
            np.testing.assert_allclose(out[s, h], p @ v[s, h // 2], atol=2e-6)
        alone = attention.dense_attention(q[s], k[s], v[s], np.array([length]), 0.25)
        assert np.array_equal(alone, out[s])
        start += length
    rows = np.array([0, 3, 3, 20, 21, 57, 62, n - 1])          # some queries only (a pass's last layer)
    np.testing.assert_array_equal(attention.dense_attention(q, k, v, lens, 0.25, rows), out[rows])
