"""kernels/cpu/elementwise.py splits calls of PARALLEL_ROWS rows and more between numba's threads:
each row must come out bit for bit as it does alone, on the calling thread."""
import numpy as np
import pytest

from kernels.cpu import elementwise

pytestmark = pytest.mark.skipif(not elementwise.available(), reason="needs numba")

ROWS = 2 * elementwise.PARALLEL_ROWS + 5


def each_alone(f, *rows_args):
    return np.stack([f(*(a[i:i + 1] for a in rows_args))[0] for i in range(rows_args[0].shape[0])])


def test_rms_norm_rows_split_between_threads_match_each_row_alone():
    rng = np.random.default_rng(1)
    x = (rng.standard_normal((ROWS, 640)) * 3).astype(np.float32)
    w = rng.standard_normal(640).astype(np.float32)
    together = elementwise.rms_norm(x, w, 1e-6)
    np.testing.assert_array_equal(together, each_alone(lambda r: elementwise.rms_norm(r, w, 1e-6), x))
    hw = rng.standard_normal((5, 128)).astype(np.float32)     # per-head weights (QK-norm)
    fused = (rng.standard_normal((ROWS, 6 * 128)) * 3).astype(np.float32)
    heads = fused[:, :5 * 128].reshape(ROWS, 5, 128)          # Q and K heads: a view of the fused projection
    assert not heads.flags.c_contiguous
    normed = elementwise.rms_norm(heads, hw, 1e-6)
    np.testing.assert_array_equal(normed, elementwise.rms_norm(np.ascontiguousarray(heads), hw, 1e-6))
    np.testing.assert_array_equal(normed, each_alone(lambda r: elementwise.rms_norm(r, hw, 1e-6), heads))
    want = heads / np.sqrt((heads.astype(np.float64) ** 2).mean(-1, keepdims=True) + 1e-6) * hw
    np.testing.assert_allclose(normed, want, rtol=1e-5, atol=1e-6)
    one = elementwise.rms_norm(x[0], w, 1e-6)                  # a single row, 1-D
    np.testing.assert_array_equal(one, together[0])


@pytest.mark.parametrize("name", ["swiglu", "gelu_tanh_gate"])
def test_gated_rows_split_between_threads_match_each_row_alone(name):
    rng = np.random.default_rng(2)
    fused = (rng.standard_normal((ROWS, 2 * 1000)) * 4).astype(np.float32)
    gate, up = fused[:, :1000], fused[:, 1000:]           # views of a fused projection, as the models pass them
    f = getattr(elementwise, name)
    together = f(gate, up)
    assert np.isfinite(together).all() and np.abs(together).max() > 0
    np.testing.assert_array_equal(together, each_alone(f, gate, up))


@pytest.mark.parametrize("neox", [False, True])
def test_rope_rows_split_between_threads_match_each_row_alone(neox):
    rng = np.random.default_rng(3)
    x = rng.standard_normal((ROWS, 3, 64)).astype(np.float32)
    angles = rng.uniform(0, 100, (ROWS, 24)).astype(np.float32)
    cos, sin = np.cos(angles), np.sin(angles)
    together = elementwise.rope(x, cos, sin, 48, neox)
    np.testing.assert_array_equal(together[:, :, 48:], x[:, :, 48:])
    np.testing.assert_array_equal(together, each_alone(lambda a, c, s: elementwise.rope(a, c, s, 48, neox),
                                                       x, cos, sin))
