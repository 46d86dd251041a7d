"""The vector kernels under every causal row's attention (kernels/cpu/key_scores.py,
kernels/cpu/value_sums.py): each query's result is one fixed order of float operations whichever
queries share the call and whichever vector lane holds it, so it must equal, bit for bit, the same
order taken one value at a time; and it must be the dot product / weighted sum to float32's accuracy."""
import numpy as np
import pytest

from kernels.cpu import key_scores, value_sums

pytestmark = pytest.mark.skipif(not key_scores.available(), reason="needs numba")

if key_scores.available():
    from numba import njit

    @njit(cache=True)
    def _scores(qs, n_pairs, keys, j0, out, out_at, out_stride, lane_lo, lane_hi):
        keys_t = np.empty((keys.shape[1], key_scores.KEYS), np.float32)
        key_scores.transpose_keys(keys, j0, keys_t)
        key_scores.score_pairs(qs, 0, n_pairs, keys_t, out, out_at, out_stride, lane_lo, lane_hi)
        return keys_t

    @njit(cache=True)
    def _grouped_scores(qs, n_pairs, keys_t, out, out_at, out_stride, lane_lo, lane_hi):
        key_scores.score_pairs(qs, 0, n_pairs, keys_t, out, out_at, out_stride, lane_lo, lane_hi)

    @njit(cache=True)
    def _half_keys_transposed(cache, kv, block, j0, keys_t, g):
        key_scores.transpose_half_keys(cache, kv, block, j0, keys_t, g)

    @njit(cache=True)
    def _scores_one_at_a_time(qs, n_pairs, keys, j0, out):
        for p in range(n_pairs):
            for lane in range(key_scores.KEYS):
                out[p, lane] = key_scores.score_scalar(qs, p * keys.shape[1], keys, j0 + lane)

    @njit(cache=True)
    def _weigh(weights, w_at, w_stride, n_pairs, values, j0, j1, acc):
        value_sums.weigh_pairs(weights, w_at, w_stride, n_pairs, values, j0, j1, acc, 0)

    @njit(cache=True)
    def _weigh_one_at_a_time(weights, w_at, w_stride, n_pairs, values, j0, j1, acc):
        dim = values.shape[1]
        for p in range(n_pairs):
            for d in range(dim):
                total = acc[p * dim + d]
                for j in range(j0, j1):
                    total = key_scores.fma(weights[w_at + p * w_stride + j], values[j, d], total)
                acc[p * dim + d] = total


@pytest.mark.parametrize("dim", [16, 64, 80, 256])
@pytest.mark.parametrize("n_pairs", [1, 3, 4, 7, 8, 9, 13, 48])
def test_scores_are_one_sum_per_key_whatever_shares_the_call(dim, n_pairs):
    rng = np.random.default_rng(dim * 100 + n_pairs)
    keys = rng.standard_normal((40, dim)).astype(np.float32)
    qs = rng.standard_normal((n_pairs, dim)).astype(np.float32)
    out = np.full((n_pairs, 16), np.nan, np.float32)
    keys_t = _scores(qs.reshape(-1), n_pairs, keys, 16, out.reshape(-1), 0, 16, 0, 16)
    np.testing.assert_array_equal(keys_t, keys[16:32].T)
    alone = np.empty_like(out)
    _scores_one_at_a_time(qs.reshape(-1), n_pairs, keys, 16, alone)
    np.testing.assert_array_equal(out, alone)
    exact = qs.astype(np.float64) @ keys[16:32].T.astype(np.float64)
    np.testing.assert_allclose(out, exact, rtol=0, atol=4e-6 * np.sqrt(dim) * np.abs(exact).max())
    for first in range(n_pairs):                  # the same query among fewer others: the same bits
        some = np.full((n_pairs - first, 16), np.nan, np.float32)
        _scores(qs[first:].reshape(-1), n_pairs - first, keys, 16, some.reshape(-1), 0, 16, 0, 16)
        np.testing.assert_array_equal(some, out[first:])


def test_scores_store_only_the_lanes_of_keys_a_row_sees():
    rng = np.random.default_rng(7)
    keys = rng.standard_normal((16, 64)).astype(np.float32)
    qs = rng.standard_normal((5, 64)).astype(np.float32)
    full = np.empty((5, 16), np.float32)
    _scores(qs.reshape(-1), 5, keys, 0, full.reshape(-1), 0, 16, 0, 16)
    out = np.full((5, 30), -7.0, np.float32)       # lane 0 at column 10: lanes 3-10 are columns 13-20
    _scores(qs.reshape(-1), 5, keys, 0, out.reshape(-1), 10, 30, 3, 11)
    np.testing.assert_array_equal(out[:, 13:21], full[:, 3:11])
    assert (out[:, :13] == -7).all() and (out[:, 21:] == -7).all()
    nothing = np.full((5, 16), -7.0, np.float32)
    _scores(qs.reshape(-1), 5, keys, 0, nothing.reshape(-1), 0, 16, 9, 9)
    assert (nothing == -7).all()


@pytest.mark.parametrize("dim", [16, 32, 48, 64, 80, 256])
@pytest.mark.parametrize("n_pairs", [1, 2, 3, 5, 6, 7, 11, 48])
@pytest.mark.parametrize("j0,j1", [(0, 16), (3, 11), (5, 5)])
def test_weighted_values_are_one_chain_per_lane_whatever_shares_the_call(dim, n_pairs, j0, j1):
    rng = np.random.default_rng(dim + 7 * n_pairs + j0)
    values = rng.standard_normal((16, dim)).astype(np.float32)
    weights = rng.random(n_pairs * 40).astype(np.float32)
    start = rng.standard_normal(n_pairs * dim).astype(np.float32)
    got, want = start.copy(), start.copy()
    _weigh(weights, 2, 40, n_pairs, values, j0, j1, got)
    _weigh_one_at_a_time(weights, 2, 40, n_pairs, values, j0, j1, want)
    np.testing.assert_array_equal(got, want)
    w = weights.reshape(n_pairs, 40)[:, 2 + j0:2 + j1].astype(np.float64)
    exact = start.reshape(n_pairs, dim) + w @ values[j0:j1].astype(np.float64)
    np.testing.assert_allclose(got.reshape(n_pairs, dim), exact, rtol=0, atol=1e-5)
    last = start[(n_pairs - 1) * dim:].copy()       # the last query alone: the same bits
    _weigh(weights[(n_pairs - 1) * 40:], 2, 40, 1, values, j0, j1, last)
    np.testing.assert_array_equal(last, got[(n_pairs - 1) * dim:])


@pytest.mark.parametrize("dim", [16, 64, 256])
@pytest.mark.parametrize("n_pairs", [1, 2, 3, 4, 5, 9])
@pytest.mark.parametrize("n_groups", [1, 2, 3, 4, 7])
def test_grouped_scores_are_each_keys_own_sum(dim, n_pairs, n_groups):
    """Groups of 16 keys side by side (a decode row's few heads against several groups a call):
    each score the same bits as alone, only the lanes [lane_lo, lane_hi) over all groups stored."""
    rng = np.random.default_rng(dim + 10 * n_pairs + 100 * n_groups)
    keys = rng.standard_normal((16 * n_groups, dim)).astype(np.float32)
    qs = rng.standard_normal((n_pairs, dim)).astype(np.float32)
    keys_t = np.ascontiguousarray(keys.reshape(n_groups, 16, dim).transpose(0, 2, 1))
    alone = np.empty((n_pairs, 16 * n_groups), np.float32)
    for g in range(n_groups):
        block = np.empty((n_pairs, 16), np.float32)
        _scores_one_at_a_time(qs.reshape(-1), n_pairs, keys, 16 * g, block)
        alone[:, 16 * g:16 * (g + 1)] = block
    width = 16 * n_groups + 9
    for lane_lo, lane_hi in ((0, 16 * n_groups), (5, 16 * n_groups - 3), (17, 18)):
        out = np.full((n_pairs, width), -7.0, np.float32)
        _grouped_scores(qs.reshape(-1), n_pairs, keys_t, out.reshape(-1), 4, width, lane_lo, lane_hi)
        stored = slice(4 + max(lane_lo, 0), 4 + max(min(lane_hi, 16 * n_groups), lane_lo))
        np.testing.assert_array_equal(out[:, stored], alone[:, stored.start - 4:stored.stop - 4])
        assert (out[:, :stored.start] == -7).all() and (out[:, stored.stop:] == -7).all()


def test_half_keys_are_converted_and_transposed_in_place():
    rng = np.random.default_rng(3)
    keys = rng.standard_normal((2, 3, 32, 64)).astype(np.float16)      # [kv, block, row, value]
    cache = keys.view(np.uint8)
    keys_t = np.full((3, 64, 16), np.nan, np.float32)
    _half_keys_transposed(cache, 1, 2, 16, keys_t, 1)
    np.testing.assert_array_equal(keys_t[1], keys[1, 2, 16:32].astype(np.float32).T)
    assert np.isnan(keys_t[0]).all() and np.isnan(keys_t[2]).all()
