"""Compiled element-wise kernels for the CPU backend: one call instead of several numpy passes.

A decode step runs ~60 RMSNorms on one row each; in numpy each was five array
operations (~33 us), compiled they take 0.7 ms a step instead of 2.0 (one
sequence, AVX2, 2 cores). The sum of
squares is accumulated in float64, as ggml's rms_norm does. exp is Cephes'
expf written as loops LLVM vectorizes (numba's own exp is a libm call per
element); it serves SwiGLU and the tanh-GELU gate (as a logistic) here and the softmax of
decode attention. The row functions are shared with the replayed decode passes of
kernels/cpu/graph_replay.py, so both compute each row the same way.
"""
from __future__ import annotations

import numpy as np

try:
    from numba import get_num_threads, njit, prange
except ImportError:  # pragma: no cover - exercised only where numba is missing
    njit = None

# Calls of this many rows and more (a prompt's chunk, large decode batches) split their rows between
# numba's threads, each row computed as alone; fewer stay on the calling thread. A 512-token Gemma 3
# prefill chunk spent ~8 % of its time in these on one thread while the other waited.
PARALLEL_ROWS = 16


def available() -> bool:
    return njit is not None


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """x [..., d] normalised over its last axis, times `weight`: [d], or [h, d] for x [..., h, d]."""
    d = x.shape[-1]
    # by tokens: a view of a fused projection's Q and K heads (QK-norm) is read in place
    tokens = x.reshape(-1, d) if x.ndim < 3 else x.reshape(x.shape[0], -1)
    flat, stride = _flat_rows(tokens)
    w = np.ascontiguousarray(weight, dtype=np.float32).reshape(-1, d)
    out = np.empty((x.size // d, d), np.float32)
    args = (flat, stride, tokens.shape[1] // d, w, np.float64(eps), out)
    if out.shape[0] >= PARALLEL_ROWS:
        _rms_norm_parallel(*args, get_num_threads())
    else:
        _rms_norm_kernel(*args)
    return out.reshape(x.shape)


def swiglu(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """silu(gate) * up = gate * up / (1 + exp(-gate)), for [rows, n] halves of a fused projection."""
    return _gated(SWIGLU, gate, up)


def gelu_tanh_gate(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """tanh-GELU(gate) * up, for [..., n] halves of a fused projection."""
    return _gated(GELU_TANH_GATE, gate, up)


def _gated(gate_kind: int, gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    n = gate.shape[-1]
    out = np.empty(gate.shape, np.float32)
    (gate_flat, gate_stride), (up_flat, up_stride) = _flat_rows(gate.reshape(-1, n)), _flat_rows(up.reshape(-1, n))
    args = (gate_kind, gate_flat, gate_stride, up_flat, up_stride, out.reshape(-1, n), np.empty(n, np.int32))
    if args[5].shape[0] >= PARALLEL_ROWS:
        _gated_parallel(*args, get_num_threads())
    else:
        _gated_kernel(*args)
    return out


def _flat_rows(rows: np.ndarray) -> tuple[np.ndarray, int]:
    """[r, n] float32 rows as one contiguous 1-D view from the first element to the last, and the
    row stride in elements. The halves of a fused projection are views with a row stride of 2n:
    numba compiles those ('A' layout) with strided loads that do not vectorize (95 us for 32 of
    SmolLM2's rows, against 37 for contiguous rows); slices of a contiguous view do."""
    if rows.dtype != np.float32 or rows.strides[1] != 4 or rows.strides[0] % 4 or rows.flags.c_contiguous:
        rows = np.ascontiguousarray(rows, dtype=np.float32)
        flat = rows.reshape(-1).view()
        flat.flags.writeable = False        # read-only either way: one compiled signature, the one warm_up compiles
        return flat, rows.shape[1]
    stride = rows.strides[0] // 4
    span = (rows.shape[0] - 1) * stride + rows.shape[1]
    return np.lib.stride_tricks.as_strided(rows, shape=(span,), strides=(4,), writeable=False), stride


def rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, n_dims: int, neox: bool) -> np.ndarray:
    """x [tokens, heads, d] rotated by its tokens' angles (cos/sin [tokens, n_dims // 2]);
    dimensions past n_dims are copied. The same float32 products and sums as numpy's, in one
    pass: 32 decode rows of SmolLM2's 12 heads took 85 us in numpy's eight array operations,
    18-21 here (Zen 3 EPYC)."""
    x = np.ascontiguousarray(x, dtype=np.float32)    # a view of the fused projection: copied, the loops then vectorize
    out = np.empty(x.shape, np.float32)
    args = (x, np.ascontiguousarray(cos, dtype=np.float32), np.ascontiguousarray(sin, dtype=np.float32), n_dims, neox,
            out)
    if x.shape[0] >= PARALLEL_ROWS:
        _rope_parallel(*args, get_num_threads())
    else:
        _rope_kernel(*args)
    return out


def exp_sums(logits: np.ndarray, shifts: np.ndarray) -> np.ndarray:
    """float64 sum(exp(row - shift)) of each row of a float32 [n, V] array, on the calling thread
    (the sampler runs after passes on either thread pool, and must not bring in the other)."""
    out = np.empty(logits.shape[0], np.float64)
    _exp_sum_kernel(logits, np.ascontiguousarray(shifts, dtype=np.float32), out,
                    np.empty(4096, np.float32), np.empty(4096, np.int32))
    return out


def exp_shifted(values, shift, bits):  # pragma: no cover - compiled by numba
    """values[:] = exp(values - shift) in place (inputs clamped to [-87, 88]); `bits` is
    int32 scratch of at least values' length."""
    n_values = values.shape[0]
    for i in range(n_values):
        x = min(max(values[i] - shift, np.float32(-87.0)), np.float32(88.0))
        n = np.floor(x * np.float32(1.44269504088896341) + np.float32(0.5))
        r = x - n * np.float32(0.693359375) + n * np.float32(2.12194440e-4)
        p = np.float32(1.9875691500e-4)
        p = p * r + np.float32(1.3981999507e-3)
        p = p * r + np.float32(8.3334519073e-3)
        p = p * r + np.float32(4.1665795894e-2)
        p = p * r + np.float32(1.6666665459e-1)
        p = p * r + np.float32(5.0000001201e-1)
        values[i] = p * r * r + r + np.float32(1.0)
        bits[i] = (np.int32(n) + np.int32(127)) << np.int32(23)     # the float 2**n
    powers = bits[:n_values].view(np.float32)
    for i in range(n_values):
        values[i] *= powers[i]


def row_max(row):  # pragma: no cover - compiled by numba
    """max(row) (not empty, no NaN) in eight running maxima: a single one is a chain of dependent
    compares that does not vectorize (on a Zen 4 EPYC with AVX2, 0.62 ns an element that way,
    0.19 this way)."""
    b0 = b1 = b2 = b3 = b4 = b5 = b6 = b7 = row[0]
    n = row.shape[0]
    j = 0
    while j + 8 <= n:
        b0 = row[j] if row[j] > b0 else b0
        b1 = row[j + 1] if row[j + 1] > b1 else b1
        b2 = row[j + 2] if row[j + 2] > b2 else b2
        b3 = row[j + 3] if row[j + 3] > b3 else b3
        b4 = row[j + 4] if row[j + 4] > b4 else b4
        b5 = row[j + 5] if row[j + 5] > b5 else b5
        b6 = row[j + 6] if row[j + 6] > b6 else b6
        b7 = row[j + 7] if row[j + 7] > b7 else b7
        j += 8
    b0, b2, b4, b6 = max(b0, b1), max(b2, b3), max(b4, b5), max(b6, b7)
    best = max(max(b0, b2), max(b4, b6))
    for j in range(j, n):
        best = max(best, row[j])
    return best


def softmax_numerators(row, bits):  # pragma: no cover - compiled by numba
    """row[:] = exp(row - max(row)) in place, returning their float32 sum: the softmax of decode
    attention's rows and of a prompt tile's, `bits` exp_shifted's scratch."""
    exp_shifted(row, row_max(row), bits)
    total = np.float32(0.0)
    for i in range(row.shape[0]):
        total += row[i]
    return total


def tile_softmax(scores, visible_end, window, bits, totals):  # pragma: no cover - compiled by numba
    """Each row of scores [m, t, n] (m heads of t queries over n keys) turned in place into the
    numerators of its softmax, totals[h, r] their sum: query r sees the keys before
    visible_end - t + r + 1 (a causal tile's last query sees every key: visible_end = n; no limit
    if visible_end < 0) and, with window > 0, none before that end minus the window; the keys it
    does not see become 0. One call instead of numpy's mask, max, exp and sum over the whole
    tile: 0.69-0.74 ns an element against 2.4-2.7 (SmolLM2's 512-token prefill: 3 KV heads x 384
    rows x up to 512 keys a tile, 30 layers; in-process A/B on a Zen 4 EPYC with AVX2, whole
    prefills 0.94-0.95 of the time, Gemma 3 0.98)."""
    m, t, n = scores.shape
    for h in range(m):
        for r in range(t):
            row = scores[h, r]
            hi = n if visible_end < 0 else visible_end - t + r + 1
            lo = max(0, hi - window) if window > 0 else 0
            # a slice indexed from 0: loops from a variable start do not vectorize
            totals[h, r] = softmax_numerators(row[lo:hi], bits)
            row[:lo] = np.float32(0.0)
            row[hi:] = np.float32(0.0)


def round_to_half(values):  # pragma: no cover - compiled by numba
    """values[:] (contiguous float32) rounded in place to the nearest float16 value, ties to even,
    as F16C's conversion rounds (finite values below float16's 65520 overflow)."""
    raw = values.view(np.int32)
    for i in range(values.shape[0]):
        u = raw[i]
        if (u & 0x7FFFFFFF) < 0x38800000:       # below 2**-14: a float16 subnormal, a multiple of 2**-24
            values[i] = np.float32(np.rint(values[i] * np.float32(16777216.0)) * np.float32(5.9604645e-08))
        else:                                   # keep 10 of float32's 23 mantissa bits
            raw[i] = (u + np.int32(0x0FFF) + ((u >> np.int32(13)) & np.int32(1))) & np.int32(-8192)


def swiglu_row(gate, up, out, bits):  # pragma: no cover - compiled by numba
    """out[:] = silu(gate) * up = gate * up / (1 + exp(-gate)) for one row."""
    for j in range(out.shape[0]):
        out[j] = -gate[j]
    exp_shifted(out, np.float32(0.0), bits)
    for j in range(out.shape[0]):
        out[j] = gate[j] * up[j] / (np.float32(1.0) + out[j])


def gelu_tanh_gate_row(gate, up, out, bits):  # pragma: no cover - compiled by numba
    """out[:] = 0.5 g (1 + tanh(y)) * up with y = sqrt(2/pi) (g + 0.044715 g^3), computed as
    g * up / (1 + exp(-2y)) (the same function: 0.5 (1 + tanh(y)) is the logistic of 2y)."""
    for j in range(out.shape[0]):
        g = gate[j]
        out[j] = np.float32(-2.0 * 0.7978845608028654) * (g + np.float32(0.044715) * g * g * g)
    exp_shifted(out, np.float32(0.0), bits)
    for j in range(out.shape[0]):
        out[j] = gate[j] * up[j] / (np.float32(1.0) + out[j])


def rms_norm_row(x, weight, eps, out):  # pragma: no cover - compiled by numba
    """out[:] = x / sqrt(mean(x^2) + eps) * weight for one row, the sum of squares in float64."""
    d = x.shape[0]
    acc = 0.0
    for j in range(d):
        v = x[j]
        acc += np.float64(v * v)
    scale = np.float32(1.0 / np.sqrt(acc / d + eps))
    for j in range(d):
        out[j] = (x[j] * scale) * weight[j]


SWIGLU, GELU_TANH_GATE = 0, 1     # the gate of _gated_range


def _gated_range(gate_kind, gate, gate_stride, up, up_stride, out, bits, lo, hi):  # pragma: no cover - compiled
    n = out.shape[1]
    for i in range(lo, hi):
        g, u = gate[i * gate_stride:i * gate_stride + n], up[i * up_stride:i * up_stride + n]
        if gate_kind == SWIGLU:
            swiglu_row(g, u, out[i], bits)
        else:
            gelu_tanh_gate_row(g, u, out[i], bits)


def _rope_range(x, cos_rows, sin_rows, n_dims, neox, out, lo, hi):  # pragma: no cover - compiled by numba
    half = n_dims // 2
    for t in range(lo, hi):
        cos, sin = cos_rows[t], sin_rows[t]
        for h in range(x.shape[1]):
            src, dst = x[t, h], out[t, h]
            for j in range(half):
                i0 = j if neox else 2 * j
                i1 = i0 + half if neox else i0 + 1
                x0, x1 = src[i0], src[i1]
                dst[i0] = x0 * cos[j] - x1 * sin[j]
                dst[i1] = x0 * sin[j] + x1 * cos[j]
            for j in range(n_dims, x.shape[2]):
                dst[j] = src[j]


def _rms_norm_range(x, stride, per_token, weight, eps, out, lo, hi):  # pragma: no cover - compiled by numba
    """out[i] = row i of x (token i // per_token at x[token * stride:], row i % per_token of it) normalised."""
    d, n_weights = out.shape[1], weight.shape[0]
    for i in range(lo, hi):
        start = i // per_token * stride + i % per_token * d
        rms_norm_row(x[start:start + d], weight[i % n_weights], eps, out[i])


# Each kernel twice: all rows on the calling thread, and in `shares` contiguous shares of them, one a
# thread (the number of threads passed in: read in compiled code, it would keep the code from numba's cache).
# (Two functions, not one compiled with and without parallel=True: numba's cache keys a function's
# compiled code on its signature, not its options, and would give both the same code.)
def _gated_rows(gate_kind, gate, gate_stride, up, up_stride, out, bits):  # pragma: no cover - compiled by numba
    _gated_range(gate_kind, gate, gate_stride, up, up_stride, out, bits, 0, out.shape[0])


def _gated_on_threads(gate_kind, gate, gate_stride, up, up_stride, out, bits, shares):  # pragma: no cover - compiled
    rows = out.shape[0]
    for s in prange(shares):
        _gated_range(gate_kind, gate, gate_stride, up, up_stride, out, np.empty(out.shape[1], np.int32),
                     rows * s // shares, rows * (s + 1) // shares)


def _rope_rows(x, cos_rows, sin_rows, n_dims, neox, out):  # pragma: no cover - compiled by numba
    _rope_range(x, cos_rows, sin_rows, n_dims, neox, out, 0, x.shape[0])


def _rope_on_threads(x, cos_rows, sin_rows, n_dims, neox, out, shares):  # pragma: no cover - compiled by numba
    rows = x.shape[0]
    for s in prange(shares):
        _rope_range(x, cos_rows, sin_rows, n_dims, neox, out, rows * s // shares, rows * (s + 1) // shares)


def _rms_norm_rows(x, stride, per_token, weight, eps, out):  # pragma: no cover - compiled by numba
    _rms_norm_range(x, stride, per_token, weight, eps, out, 0, out.shape[0])


def _rms_norm_on_threads(x, stride, per_token, weight, eps, out, shares):  # pragma: no cover - compiled by numba
    rows = out.shape[0]
    for s in prange(shares):
        _rms_norm_range(x, stride, per_token, weight, eps, out, rows * s // shares, rows * (s + 1) // shares)


if available():
    exp_shifted = njit(fastmath=True, cache=True, nogil=True)(exp_shifted)
    round_to_half = njit(cache=True, nogil=True)(round_to_half)
    # numpy's error model: under Python's, every division checks its divisor for zero and the
    # loop stays scalar (a SwiGLU row took 1.89 ns an element, 0.63 vectorized); without "arcp"
    # the vector division is the exact one, so the results are those of the scalar loop
    _EXACT_FASTMATH = {"nnan", "ninf", "nsz", "contract", "afn", "reassoc"}
    swiglu_row = njit(fastmath=_EXACT_FASTMATH, error_model="numpy", cache=True, nogil=True)(swiglu_row)
    gelu_tanh_gate_row = njit(fastmath=_EXACT_FASTMATH, error_model="numpy", cache=True, nogil=True)(gelu_tanh_gate_row)
    rms_norm_row = njit(fastmath=True, cache=True, nogil=True)(rms_norm_row)
    row_max = njit(fastmath=True, cache=True, nogil=True)(row_max)
    softmax_numerators = njit(fastmath=True, cache=True, nogil=True)(softmax_numerators)
    tile_softmax = njit(fastmath=True, cache=True, nogil=True)(tile_softmax)
    _gated_range, _rope_range, _rms_norm_range = (
        njit(cache=True, nogil=True)(f) for f in (_gated_range, _rope_range, _rms_norm_range))
_rms_norm_kernel = njit(cache=True, nogil=True)(_rms_norm_rows) if available() else None
_gated_kernel = njit(cache=True, nogil=True)(_gated_rows) if available() else None
_rope_kernel = njit(cache=True, nogil=True)(_rope_rows) if available() else None
_rms_norm_parallel = njit(cache=True, nogil=True, parallel=True)(_rms_norm_on_threads) if available() else None
_gated_parallel = njit(cache=True, nogil=True, parallel=True)(_gated_on_threads) if available() else None
_rope_parallel = njit(cache=True, nogil=True, parallel=True)(_rope_on_threads) if available() else None


def _exp_sum_rows(logits, shifts, out, chunk, bits):  # pragma: no cover - compiled by numba
    for i in range(logits.shape[0]):
        total = 0.0
        for start in range(0, logits.shape[1], chunk.shape[0]):
            part = chunk[:min(chunk.shape[0], logits.shape[1] - start)]
            part[:] = logits[i, start:start + part.shape[0]]
            exp_shifted(part, shifts[i], bits)
            for j in range(part.shape[0]):
                total += np.float64(part[j])
        out[i] = total


_exp_sum_kernel = njit(fastmath=True, cache=True, nogil=True)(_exp_sum_rows) if available() else None


def warm_up() -> None:
    """Compile (or load from numba's cache) the kernels."""
    if available():
        for rows in (1, PARALLEL_ROWS):    # on the calling thread, and on all threads
            rms_norm(np.ones((rows, 8), np.float32), np.ones(8, np.float32), 1e-6)
            both = np.ones((rows, 16), np.float32)
            swiglu(both[:, :8], both[:, 8:])
            for neox in (False, True):     # the [tokens, heads, d] views of a fused projection's rows
                angles = np.ones((rows, 4), np.float32)
                rope(both[:, :16].reshape(rows, 2, 8), angles, angles, 8, neox)
            gelu_tanh_gate(both[:, :8], both[:, 8:])
        exp_sums(both[:1], np.zeros(1))
        tile_scores = np.ones((1, 2, 4), np.float32)
        tile_softmax(tile_scores, 4, 0, np.empty(4, np.int32), np.empty((1, 2), np.float32))
