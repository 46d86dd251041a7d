"""kernels/cpu against plain reference implementations (loops, float64).

The references follow llama.cpp's definitions: RMSNorm as ggml_rms_norm,
RoPE as ggml_rope (LLAMA_ROPE_TYPE_NORM rotates adjacent pairs, NEOX the two
halves of the first n_dims dims), attention as softmax(q.k * scale) v with
query head h reading KV head h // (n_heads / n_kv_heads), and the sliding
window rule of llama.cpp's KV cache: a query at position p sees keys k with
p - window < k <= p.
"""
from __future__ import annotations

import math
import sys
import warnings
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernels import AttentionMetadata  # noqa: E402
from kernels.cpu import CPUBackend  # noqa: E402

RTOL, ATOL = 1e-4, 1e-5


@pytest.fixture
def ops() -> CPUBackend:
    return CPUBackend()


def close(actual, expected, rtol=RTOL, atol=ATOL):
    np.testing.assert_allclose(np.asarray(actual, np.float64), expected, rtol=rtol, atol=atol)


# --- references ----------------------------------------------------------------------------


def ref_rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    x = x.astype(np.float64).reshape(-1, x.shape[-1])
    out = np.empty_like(x)
    for r, row in enumerate(x):
        mean_sq = sum(float(v) * float(v) for v in row) / len(row)
        out[r] = row / math.sqrt(mean_sq + eps) * w
    return out


def ref_rope(x: np.ndarray, positions, base: float, n_dims: int, neox: bool) -> np.ndarray:
    """ggml_rope_f32: theta_i = p * base^(-2i/n_dims) for pair i; dims >= n_dims pass through."""
    out = x.astype(np.float64).copy()
    n_tok, n_heads, _ = x.shape
    for t in range(n_tok):
        p = int(positions[t])
        for h in range(n_heads):
            for i in range(n_dims // 2):
                theta = p * base ** (-2.0 * i / n_dims)
                c, s = math.cos(theta), math.sin(theta)
                a, b = (i, i + n_dims // 2) if neox else (2 * i, 2 * i + 1)
                x0, x1 = float(x[t, h, a]), float(x[t, h, b])
                out[t, h, a] = x0 * c - x1 * s
                out[t, h, b] = x0 * s + x1 * c
    return out


def ref_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float, window: int = 0,
                  causal: bool = True) -> np.ndarray:
    """q [n_q, H, d] are the last n_q positions of a context whose keys/values are k, v [ctx, KV, d]."""
    n_q, n_heads, dim = q.shape
    ctx, n_kv, _ = k.shape
    group = n_heads // n_kv
    out = np.zeros((n_q, n_heads, dim))
    for i in range(n_q):
        p = ctx - n_q + i
        if causal:
            visible = [j for j in range(ctx) if j <= p and (window <= 0 or j > p - window)]
        else:
            visible = list(range(ctx))
        for h in range(n_heads):
            kv = h // group
            scores = [scale * float(np.dot(q[i, h].astype(np.float64), k[j, kv].astype(np.float64)))
                      for j in visible]
            m = max(scores)
            weights = [math.exp(s - m) for s in scores]
            total = sum(weights)
            for wgt, j in zip(weights, visible):
                out[i, h] += wgt / total * v[j, kv].astype(np.float64)
    return out


# --- paged-attention harness ----------------------------------------------------------------


def stored(x: np.ndarray, codec: str) -> np.ndarray:
    """The float32 values a KV pool of `codec` holds for rows x [..., head_dim]: float16-rounded, or
    quantized and dequantized by gguf's numpy reference of ggml's Q8_0 / Q4_0."""
    if codec == "f16":
        return x.astype(np.float16).astype(np.float32)
    qtype = {"q8_0": GGMLQuantizationType.Q8_0, "q4_0": GGMLQuantizationType.Q4_0}[codec]
    rows = x.reshape(-1, x.shape[-1]).astype(np.float32)
    return gguf.quants.dequantize(gguf.quants.quantize(rows, qtype), qtype).reshape(x.shape).astype(np.float32)


class Paged:
    """Sequences with contiguous K/V, copied into a paged cache through shuffled block tables."""

    def __init__(self, ops: CPUBackend, seqs: list[tuple[int, int]], n_heads: int, n_kv: int, dim: int,
                 block_size: int = 4, shuffle: bool = True, causal: bool = True, seed: int = 0,
                 physical: np.ndarray | None = None, codec: str = "f16"):
        """seqs: (context_len, query_len) per sequence, in packing order; `physical`: the block ids
        handed out in order (default: a permutation, or 0, 1, ... without `shuffle`). self.k and
        self.v are the values the pool holds (float16-rounded or quantized by `codec`)."""
        rng = np.random.default_rng(seed)
        self.ops, self.seqs, self.causal, self.codec = ops, seqs, causal, codec
        blocks_needed = [-(-ctx // block_size) for ctx, _ in seqs]
        num_blocks = sum(blocks_needed) + 3            # spare blocks hold garbage that must never be read
        if physical is None:
            physical = rng.permutation(num_blocks) if shuffle else np.arange(num_blocks)
        num_blocks = max(num_blocks, int(np.max(physical)) + 2)
        self.k_cache, self.v_cache = ops.alloc_kv(num_blocks, block_size, n_kv, dim, codec)
        garbage = (rng.standard_normal((2, num_blocks * block_size, n_kv, dim)) * 100).astype(np.float32)
        ops.store_kv(self.k_cache, self.v_cache, garbage[0], garbage[1], np.arange(num_blocks * block_size))
        max_blocks = max(blocks_needed) + 1
        tables = np.zeros((len(seqs), max_blocks), np.int32)
        self.k, self.v, self.q, slots = [], [], [], []
        used = 0
        for i, (ctx, n_q) in enumerate(seqs):
            table = physical[used:used + blocks_needed[i]]
            used += blocks_needed[i]
            tables[i, :len(table)] = table
            k = rng.standard_normal((ctx, n_kv, dim)).astype(np.float32)
            v = rng.standard_normal((ctx, n_kv, dim)).astype(np.float32)
            pos = np.arange(ctx)
            slot = table[pos // block_size].astype(np.int64) * block_size + pos % block_size
            ops.store_kv(self.k_cache, self.v_cache, k, v, slot)
            self.k.append(stored(k, codec))
            self.v.append(stored(v, codec))
            self.q.append(rng.standard_normal((n_q, n_heads, dim)).astype(np.float32))
            slots.append(slot[ctx - n_q:])
        self.meta = AttentionMetadata(np.array([n for _, n in seqs], np.int64),
                                      np.array([c for c, _ in seqs], np.int64),
                                      tables, np.concatenate(slots), causal=causal)

    def run(self, scale: float, window: int = 0) -> list[np.ndarray]:
        out = self.ops.paged_attention(np.concatenate(self.q), self.k_cache, self.v_cache, self.meta, scale, window)
        assert out.dtype == np.float32 and out.shape == (sum(n for _, n in self.seqs),) + self.q[0].shape[1:]
        return np.split(out, np.cumsum([n for _, n in self.seqs])[:-1])

    def check(self, scale: float = 0.25, window: int = 0) -> None:
        for i, got in enumerate(self.run(scale, window)):
            close(got, ref_attention(self.q[i], self.k[i], self.v[i], scale, window, self.causal))


# --- rms_norm ---------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(1, 64), (5, 48), (3, 4, 16)])
def test_rms_norm(ops, shape):
    rng = np.random.default_rng(1)
    x = (rng.standard_normal(shape) * 3).astype(np.float32)
    w = rng.standard_normal(shape[-1]).astype(np.float32)
    got = ops.rms_norm(x, w, 1e-6)
    assert got.shape == x.shape and got.dtype == np.float32
    close(got, ref_rms_norm(x, w, 1e-6).reshape(shape))


def test_rms_norm_per_head_weights_and_strided_input(ops):
    """Gemma 3's QK-norm: x [tokens, heads, d] (a slice of the fused projection) times [heads, d]."""
    rng = np.random.default_rng(2)
    fused = (rng.standard_normal((5, 7, 16)) * 2).astype(np.float32)
    x = fused[:, 1:6]                                   # not contiguous
    w = rng.standard_normal((5, 16)).astype(np.float32)
    got = ops.rms_norm(x, w, 1e-6)
    assert got.shape == x.shape
    expected = x / np.sqrt((x.astype(np.float64) ** 2).mean(-1, keepdims=True) + 1e-6) * w
    close(got, expected.astype(np.float32))


def test_rms_norm_eps_dominates_tiny_input(ops):
    x = np.full((2, 8), 1e-4, np.float32)
    w = np.ones(8, np.float32)
    close(ops.rms_norm(x, w, 1e-2), ref_rms_norm(x, w, 1e-2))


# --- rope -------------------------------------------------------------------------------------


@pytest.mark.parametrize("neox", [False, True], ids=["norm", "neox"])
@pytest.mark.parametrize("head_dim, n_dims, base", [
    (16, 16, 10000.0),
    (64, 64, 1000000.0),
    (32, 16, 10000.0),      # partial rotation: the last 16 dims pass through
    (24, 8, 500.0),
])
def test_rope(ops, neox, head_dim, n_dims, base):
    rng = np.random.default_rng(2)
    positions = np.array([0, 1, 2, 7, 100, 2047, 4095, 4096, 9000], np.int64)
    x = rng.standard_normal((len(positions), 3, head_dim)).astype(np.float32)
    x_before = x.copy()
    got = ops.rope(x, positions, base, n_dims, neox)
    np.testing.assert_array_equal(x, x_before)   # the input is not modified
    assert got.shape == x.shape and got.dtype == np.float32
    close(got, ref_rope(x, positions, base, n_dims, neox), atol=1e-4)
    np.testing.assert_array_equal(got[..., n_dims:], x[..., n_dims:])


def test_rope_rows_follow_each_positions_array(ops):
    """The cos/sin rows kept for a pass's positions array (every layer reuses them) are never served
    for another array, nor for another frequency base."""
    rng = np.random.default_rng(4)
    x = rng.standard_normal((3, 2, 8)).astype(np.float32)
    first, second = np.array([0, 7, 9]), np.array([4, 1, 30])
    for positions, base in ((first, 10000.0), (first, 10000.0), (second, 10000.0), (second, 500.0), (first, 10000.0)):
        close(ops.rope(x, positions, base, 8, True), ref_rope(x, positions, base, 8, True), atol=1e-4)


@pytest.mark.parametrize("neox", [False, True])
@pytest.mark.parametrize("n_dims", [64, 32])
def test_compiled_rope_equals_numpys_on_a_fused_projections_view(ops, monkeypatch, neox, n_dims):
    """The compiled kernel takes the Q/K heads as a view of the fused QKV rows and gives the same
    float32 values, bit for bit, as the numpy expressions it replaced."""
    from kernels.cpu import elementwise
    if not elementwise.available():
        pytest.skip("numba is not installed")
    rng = np.random.default_rng(5)
    qkv = rng.standard_normal((32, 15 * 64)).astype(np.float32)
    qk = qkv[:, :12 * 64].reshape(32, 12, 64)
    positions = rng.integers(0, 5000, 32)
    compiled = ops.rope(qk, positions, 10000.0, n_dims, neox)
    monkeypatch.setattr(elementwise, "available", lambda: False)
    np.testing.assert_array_equal(compiled, ops.rope(qk, positions, 10000.0, n_dims, neox))


def test_rope_norm_and_neox_differ(ops):
    rng = np.random.default_rng(3)
    x = rng.standard_normal((2, 1, 8)).astype(np.float32)
    pos = np.array([3, 5])
    assert not np.allclose(ops.rope(x, pos, 10000.0, 8, False), ops.rope(x, pos, 10000.0, 8, True))


def test_rope_position_zero_is_identity_and_cache_keys(ops):
    """Tables are cached per (base, n_dims): mixing bases and sizes on one backend must not mix tables."""
    rng = np.random.default_rng(4)
    x = rng.standard_normal((4, 2, 32)).astype(np.float32)
    pos = np.array([0, 3, 17, 200])
    for base, n_dims, neox in [(10000.0, 32, False), (10.0, 32, False), (10000.0, 16, True), (10.0, 16, True),
                               (10000.0, 32, False)]:
        got = ops.rope(x, pos, base, n_dims, neox)
        close(got, ref_rope(x, pos, base, n_dims, neox), atol=1e-4)
        np.testing.assert_array_equal(got[0], x[0])


def test_rope_preserves_pair_norms(ops):
    rng = np.random.default_rng(5)
    x = rng.standard_normal((6, 2, 16)).astype(np.float32)
    got = ops.rope(x, np.arange(6) * 13, 10000.0, 16, False)
    close(np.hypot(got[..., 0::2], got[..., 1::2]), np.hypot(x[..., 0::2], x[..., 1::2]))


# --- paged attention ------------------------------------------------------------------------


def test_store_kv_writes_slots(ops):
    k_cache, v_cache = ops.alloc_kv(3, 4, 2, 8)
    k = np.arange(3 * 2 * 8, dtype=np.float32).reshape(3, 2, 8)
    slots = np.array([11, 0, 5])
    ops.store_kv(k_cache, v_cache, k, -k, slots)
    # CPU layout: [kv_heads, blocks, block_size, head_dim]
    for i, s in enumerate(slots):
        np.testing.assert_array_equal(k_cache[:, s // 4, s % 4], k[i])
        np.testing.assert_array_equal(v_cache[:, s // 4, s % 4], -k[i])
    assert np.count_nonzero(k_cache.transpose(1, 2, 0, 3).reshape(12, -1).any(axis=1)) == 3



def test_f16_store_equals_numpys_float16(ops):
    """The compiled store (rounding each row to float16 as F16C does, inf past 65504) holds what
    numpy's astype(float16) gives, for K/V rows read out of a wider product's output (not contiguous),
    in decode passes and prompt passes alike."""
    rng = np.random.default_rng(21)
    qkv = (rng.standard_normal((40, 5, 16)) * 10.0 ** rng.integers(-9, 4, (40, 5, 16))).astype(np.float32)
    qkv[0, 3, :6] = [1 + 2.0 ** -11, 1 + 3 * 2.0 ** -11, 2.0 ** -25, 0.0, 65519.0, -65520.0]  # ties, subnormal, inf
    k, v = qkv[:, 3:4], qkv[:, 4:5]                     # [tokens, 1 KV head, 16], strided
    slots = rng.permutation(64)[:40]
    k_cache, v_cache = ops.alloc_kv(16, 4, 1, 16)
    assert k_cache.dtype == np.float16
    for at, rows in ((0, 4), (4, 4), (8, 32)):
        ops.begin_pass(rows, decode=rows == 4)
        ops.store_kv(k_cache, v_cache, k[at:at + rows], v[at:at + rows], slots[at:at + rows])
    flat_k, flat_v = k_cache.reshape(1, 64, 16), v_cache.reshape(1, 64, 16)
    with np.errstate(over="ignore"):
        np.testing.assert_array_equal(flat_k[0, slots].view(np.uint16), k[:, 0].astype(np.float16).view(np.uint16))
        np.testing.assert_array_equal(flat_v[0, slots].view(np.uint16), v[:, 0].astype(np.float16).view(np.uint16))


@pytest.mark.parametrize("ctx", [1, 5, 16, 37])
def test_single_prefill_matches_naive_causal(ops, ctx):
    Paged(ops, [(ctx, ctx)], n_heads=4, n_kv=4, dim=16, block_size=16, shuffle=False).check(scale=0.25)


def test_prefill_gqa(ops):
    Paged(ops, [(29, 29)], n_heads=6, n_kv=2, dim=8, block_size=8).check(scale=1 / math.sqrt(8))


def test_decode_gqa(ops):
    Paged(ops, [(1, 1), (9, 1), (33, 1)], n_heads=6, n_kv=2, dim=8, block_size=8).check(scale=1 / math.sqrt(8))


def test_gqa_head_to_kv_mapping(ops):
    """Query heads 0-2 read KV head 0, heads 3-5 KV head 1 (h // group, as ggml broadcasts)."""
    p = Paged(ops, [(5, 5)], n_heads=6, n_kv=2, dim=4, block_size=4)
    p.v[0][:, 0, :], p.v[0][:, 1, :] = 1.0, 2.0
    slot = p.meta.block_tables[0][np.arange(5) // 4].astype(np.int64) * 4 + np.arange(5) % 4
    ops.store_kv(p.k_cache, p.v_cache, p.k[0], p.v[0], slot)
    out = p.run(0.5)[0]
    close(out[:, :3], np.ones((5, 3, 4)))
    close(out[:, 3:], np.full((5, 3, 4), 2.0))


def test_shuffled_block_tables(ops):
    p = Paged(ops, [(45, 45), (12, 12)], n_heads=4, n_kv=2, dim=16, block_size=4, shuffle=True, seed=7)
    assert not np.all(np.diff(p.meta.block_tables[0][:12]) == 1)   # really non-contiguous
    p.check()


@pytest.mark.parametrize("window", [0, 6])
@pytest.mark.parametrize("layout", ["one run", "run and tail", "three runs", "fragmented"])
@pytest.mark.parametrize("seqs", [[(150, 140)], [(61, 9)], [(61, 9), (33, 1), (20, 20)]],
                         ids=["two query tiles", "chunk after prefix", "mixed batch"])
def test_block_tables_in_runs_of_consecutive_blocks(ops, layout, seqs, window):
    """Block tables in runs of consecutive ids or fragmented give the attention of the contiguous K/V,
    inside and across query tiles."""
    runs = {"one run": [range(40, 80)],
            "run and tail": [range(3, 20), range(90, 91), range(1, 2), range(50, 80)],
            "three runs": [range(60, 75), range(5, 12), range(30, 58)],
            "fragmented": [range(b, b + 1) for b in np.random.default_rng(3).permutation(100)[:70]]}[layout]
    physical = np.concatenate([np.arange(r.start, r.stop) for r in runs])
    Paged(ops, seqs, n_heads=6, n_kv=2, dim=8, block_size=4, seed=14, physical=physical).check(window=window)


def test_mixed_batch(ops):
    """Decode rows and prefill chunks with nonzero start positions, interleaved in one packed batch."""
    seqs = [(17, 1), (40, 9), (1, 1), (23, 5), (50, 1)]   # chunks start at 31 and 18
    Paged(ops, seqs, n_heads=6, n_kv=2, dim=16, block_size=4, seed=8).check(scale=0.3)


@pytest.mark.parametrize("window", [1, 3, 4, 5, 8, 100])
def test_sliding_window_decode(ops, window):
    seqs = [(1, 1), (4, 1), (5, 1), (11, 1), (13, 1), (30, 1)]
    Paged(ops, seqs, n_heads=4, n_kv=2, dim=8, block_size=4, seed=9).check(window=window)


@pytest.mark.parametrize("window", [1, 3, 4, 5, 8, 100])
def test_sliding_window_multi_token(ops, window):
    seqs = [(11, 11), (30, 7), (13, 2), (6, 6)]
    Paged(ops, seqs, n_heads=4, n_kv=2, dim=8, block_size=4, seed=10).check(window=window)


@pytest.mark.parametrize("window", [0, 50, 200])
def test_prompts_of_several_query_tiles(ops, window):
    """Prompts longer than attention.QUERY_TILE (a tile's keys cut at its last query, windows that
    start past a tile's first keys), one after a cached prefix, through shuffled block tables."""
    seqs = [(300, 300), (420, 170)]
    Paged(ops, seqs, n_heads=6, n_kv=2, dim=8, block_size=16, seed=13).check(window=window)


@pytest.mark.parametrize("window", [2, 4, 7])
def test_sliding_window_mixed_batch(ops, window):
    seqs = [(20, 1), (26, 6), (3, 1), (9, 9), (15, 1)]
    Paged(ops, seqs, n_heads=6, n_kv=3, dim=8, block_size=4, seed=11).check(window=window)


def _positional_values(ops, ctx: int, n_q: int, block_size: int = 4):
    """q = 0 makes every visible key weigh the same; V[k] = k makes the output the mean visible position."""
    p = Paged(ops, [(ctx, n_q)], n_heads=2, n_kv=1, dim=4, block_size=block_size, seed=12)
    p.q[0][:] = 0.0
    v = np.broadcast_to(np.arange(ctx, dtype=np.float32)[:, None, None], p.v[0].shape).copy()
    table = p.meta.block_tables[0]
    pos = np.arange(ctx)
    ops.store_kv(p.k_cache, p.v_cache, p.k[0], v, table[pos // block_size].astype(np.int64) * block_size
                 + pos % block_size)
    return p


def test_sliding_window_boundary_decode(ops):
    out = _positional_values(ops, ctx=11, n_q=1).run(scale=1.0, window=4)[0]
    close(out, np.full(out.shape, (7 + 8 + 9 + 10) / 4))     # query at 10 sees 7..10, not 6


def test_sliding_window_boundary_multi_token(ops):
    out = _positional_values(ops, ctx=11, n_q=3).run(scale=1.0, window=4)[0]
    expected = np.array([(5 + 6 + 7 + 8) / 4, (6 + 7 + 8 + 9) / 4, (7 + 8 + 9 + 10) / 4])
    close(out, np.broadcast_to(expected[:, None, None], out.shape))


def test_no_window_sees_whole_prefix(ops):
    out = _positional_values(ops, ctx=11, n_q=3).run(scale=1.0, window=0)[0]
    expected = np.array([np.mean(np.arange(9)), np.mean(np.arange(10)), np.mean(np.arange(11))])
    close(out, np.broadcast_to(expected[:, None, None], out.shape))


@pytest.mark.parametrize("seqs", [[(12, 12)], [(12, 12), (7, 7)], [(20, 6)], [(9, 1)], [(5, 1), (18, 18)]],
                         ids=["one", "two", "chunk", "single_row", "single_row_and_full"])
def test_non_causal_attends_to_whole_context(ops, seqs):
    p = Paged(ops, seqs, n_heads=4, n_kv=2, dim=8, block_size=4, causal=False, seed=13)
    p.check()
    if seqs == [(12, 12)]:   # every query row really sees the last key
        out = _noncausal_positional(ops)
        close(out, np.full(out.shape, np.mean(np.arange(12))))


def _noncausal_positional(ops):
    p = _positional_values(ops, ctx=12, n_q=12)
    p.meta = AttentionMetadata(p.meta.query_lens, p.meta.context_lens, p.meta.block_tables, p.meta.slot_mapping,
                               causal=False)
    return p.run(scale=1.0)[0]


def test_attention_large_scores_are_stable(ops):
    p = Paged(ops, [(10, 10), (21, 1)], n_heads=2, n_kv=1, dim=8, block_size=4, seed=14)
    for q in p.q:
        q *= 30.0
    p.check(scale=1.0)


# --- FFN activations ---------------------------------------------------------------------------


def _gate_up(seed: int = 15, scale: float = 3.0):
    rng = np.random.default_rng(seed)
    gate = (rng.standard_normal((7, 33)) * scale).astype(np.float32)
    up = rng.standard_normal((7, 33)).astype(np.float32)
    gate[0, :6] = [0.0, -20.0, 20.0, -88.0, 88.0, -1e-3]
    return gate, up


def test_swiglu(ops):
    gate, up = _gate_up()
    g, u = gate.astype(np.float64), up.astype(np.float64)
    ref = g / (1.0 + np.exp(-g)) * u
    with warnings.catch_warnings():
        warnings.simplefilter("error")          # very negative gates overflow exp() silently, to the right 0
        got = ops.swiglu(gate, up)
    assert got.dtype == np.float32 and np.isfinite(got).all()
    close(got, ref)


def test_swiglu_on_halves_of_a_fused_projection(ops):
    """The model passes gate_up[:, :d_ff] and gate_up[:, d_ff:] (strided views); far-out gates give
    silu's limits (0 and the gate itself)."""
    rng = np.random.default_rng(16)
    fused = rng.standard_normal((3, 2 * 40)).astype(np.float32)
    fused[:, :4] = [-1000.0, -200.0, 200.0, 1000.0]
    gate, up = fused[:, :40], fused[:, 40:]
    g, u = gate.astype(np.float64), up.astype(np.float64)
    with np.errstate(over="ignore"):
        ref = g / (1.0 + np.exp(-g)) * u
    got = ops.swiglu(gate, up)
    close(got, ref)
    np.testing.assert_allclose(got[:, :4], np.array([0.0, 0.0, 200.0, 1000.0]) * u[:, :4], rtol=1e-6, atol=1e-30)


def test_gelu_tanh_gate(ops):
    gate, up = _gate_up()
    ref = np.array([[0.5 * g * (1.0 + math.tanh(math.sqrt(2.0 / math.pi) * (g + 0.044715 * g ** 3))) * u
                     for g, u in zip(grow.astype(np.float64), urow.astype(np.float64))]
                    for grow, urow in zip(gate, up)])
    got = ops.gelu_tanh_gate(gate, up)
    assert got.dtype == np.float32 and np.isfinite(got).all()
    close(got, ref)
    np.testing.assert_array_equal(gate, _gate_up()[0])   # inputs untouched


def test_gelu_tanh_close_to_exact_gelu(ops):
    g = np.linspace(-6, 6, 241).astype(np.float32)
    exact = np.array([0.5 * x * (1 + math.erf(x / math.sqrt(2))) for x in g.astype(np.float64)])
    close(ops.gelu_tanh_gate(g, np.ones_like(g)), exact, rtol=0, atol=1e-3)


# --- log_softmax and top_k ----------------------------------------------------------------------


def test_log_softmax(ops):
    rng = np.random.default_rng(16)
    x = (rng.standard_normal((4, 96)) * 5).astype(np.float32)
    x[1] += 1e4                         # large offsets must not overflow
    x[2, :] = 0.0                       # uniform row
    x[3, 7] = -1e30
    ref = np.array([[v - (max(row) + math.log(sum(math.exp(w - max(row)) for w in row))) for v in row]
                    for row in x.astype(np.float64)])
    got = ops.log_softmax(x)
    assert got.dtype == np.float32
    close(got, ref, atol=1e-4)
    close(np.exp(got.astype(np.float64)).sum(axis=-1), np.ones(4), atol=1e-5)
    close(got[2], np.full(96, -math.log(96)))


@pytest.mark.parametrize("k", [1, 4, 96, 200])
def test_top_k_ordering(ops, k):
    rng = np.random.default_rng(17)
    x = rng.permutation(np.arange(96 * 3, dtype=np.float32)).reshape(3, 96) / 7.0   # distinct values
    ids, vals = ops.top_k(x, k)
    kk = min(k, 96)
    assert ids.shape == vals.shape == (3, kk)
    for r in range(3):
        ref_ids = sorted(range(96), key=lambda j: -float(x[r, j]))[:kk]
        assert ids[r].tolist() == ref_ids
        np.testing.assert_array_equal(vals[r], x[r, ref_ids])
        assert np.all(np.diff(vals[r]) < 0)


def test_top_k_with_ties_is_best_first(ops):
    x = np.array([[0.0, 3.0, 1.0, 3.0, 2.0, 3.0, -1.0]], np.float32)
    ids, vals = ops.top_k(x, 4)
    assert vals.tolist() == [[3.0, 3.0, 3.0, 2.0]]
    assert sorted(ids[0, :3].tolist()) == [1, 3, 5] and ids[0, 3] == 4


def test_matmul_and_embedding(ops):
    rng = np.random.default_rng(18)
    x = rng.standard_normal((5, 24)).astype(np.float32)
    w = rng.standard_normal((10, 24)).astype(np.float32)
    close(ops.matmul(x, ops.prepare_weight(w)), x.astype(np.float64) @ w.astype(np.float64).T)
    # an F32 table as stored in a GGUF, and a Q8_0 one (rows decoded on lookup)
    table = ops.prepare_embedding(np.frombuffer(w.tobytes(), np.uint8), GGMLQuantizationType.F32, w.shape)
    np.testing.assert_array_equal(ops.embedding(table, np.array([3, 0, 3, 9])), w[[3, 0, 3, 9]])
    wide = rng.standard_normal((10, 64)).astype(np.float32)
    q8 = gguf.quants.quantize(wide, GGMLQuantizationType.Q8_0)
    table = ops.prepare_embedding(q8.reshape(-1), GGMLQuantizationType.Q8_0, wide.shape)
    expected = gguf.quants.dequantize(q8, GGMLQuantizationType.Q8_0)[[7, 1]]
    np.testing.assert_array_equal(ops.embedding(table, np.array([7, 1])), expected)


def test_compiled_q8_0_rows_equal_the_numpy_decoder(ops):
    """Q8_0 embedding rows decoded in one compiled call (kernels/cpu/get_rows.py) equal
    shared/dequant's numpy decoding bit for bit, scales of every kind included, and an id out of
    range gets the decoder's error."""
    from kernels.cpu import get_rows
    from shared.dequant import dequantize_rows
    rng = np.random.default_rng(5)
    n_rows, n_cols = 40, 96
    blocks = np.zeros((n_rows * n_cols // 32, 34), np.uint8)
    blocks[:, 2:] = rng.integers(0, 256, (blocks.shape[0], 32))
    scales = rng.standard_normal(blocks.shape[0]).astype(np.float16)
    scales[:6] = [0.0, -0.0, np.inf, np.nan, 6e-8, -65504.0]       # zero, inf, NaN, subnormal, extreme
    blocks[:, :2] = scales.view(np.uint8).reshape(-1, 2)
    raw = blocks.reshape(-1)
    table = ops.prepare_embedding(raw, GGMLQuantizationType.Q8_0, (n_rows, n_cols))
    assert table.compiled == get_rows.supports(raw, GGMLQuantizationType.Q8_0, (n_rows, n_cols)) \
        and (table.compiled or get_rows.njit is None)
    ids = np.array([[0, 1, 39], [7, 0, 2]])
    want = dequantize_rows(raw, GGMLQuantizationType.Q8_0, (n_rows, n_cols), ids)
    got = ops.embedding(table, ids)
    assert got.shape == (2, 3, n_cols) and got.dtype == np.float32
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
    with pytest.raises(IndexError, match=r"out of range \[0, 40\).*max 40"):
        ops.embedding(table, np.array([3, 40]))


@pytest.mark.parametrize("window", [0, 5])
def test_compiled_decode_attention_matches_numpy_path(ops, window):
    """The numba decode kernel, parallel and serial, and the numpy fallback (machines without numba)
    agree."""
    from kernels.cpu import attention, decode_attention
    if not decode_attention.available():
        pytest.skip("numba is not installed")
    p = Paged(ops, [(1, 1), (9, 1), (33, 1), (64, 1)], n_heads=6, n_kv=2, dim=16, block_size=4, seed=12)
    q = np.concatenate(p.q)
    args = (q, p.k_cache, p.v_cache, p.meta.block_tables, p.meta.context_lens, 0.3, window)
    want = attention._decode(*args).astype(np.float64)
    close(decode_attention.decode_attention(*args), want)
    close(decode_attention.decode_attention(*args, parallel=False), want)


def test_round_to_half_is_float16_rounding():
    """The softmax rounding of the 8-bit passes (llama.cpp's f16 V product) is F16C's: ties to even, subnormals."""
    from kernels.cpu import elementwise
    if not elementwise.available():
        pytest.skip("numba is not installed")
    rng = np.random.default_rng(2)
    values = np.concatenate([
        rng.random(3000).astype(np.float32) * np.float32(10.0) ** rng.integers(-9, 1, 3000).astype(np.float32),
        -rng.random(100).astype(np.float32) * 1000,
        np.float32([0.0, 1.0, 2.0 ** -14, 2.0 ** -15, 2.0 ** -24, 2.0 ** -25, 3 * 2.0 ** -25,
                    1 + 2.0 ** -11, 1 + 3 * 2.0 ** -11, 65504.0]),
    ]).astype(np.float32)
    rounded = values.copy()
    elementwise.round_to_half(rounded)
    np.testing.assert_array_equal(rounded, values.astype(np.float16).astype(np.float32))


@pytest.mark.parametrize("visible_end,window", [(-1, 0), (40, 0), (40, 7), (23, 0), (23, 5)])
def test_tile_softmax_equals_numpys_masked_softmax(visible_end, window):
    """A prefill tile's softmax numerators and totals (kernels/cpu/attention.py), against numpy's
    masked softmax: query r of t sees keys up to visible_end - t + r and, with a window, the last
    `window` of them only; what it does not see is 0."""
    from kernels.cpu import elementwise
    if not elementwise.available():
        pytest.skip("numba is not installed")
    rng = np.random.default_rng(3)
    m, t, n = 3, 9, 40
    scores = (rng.standard_normal((m, t, n)) * 4).astype(np.float32)
    expected = scores.astype(np.float64)
    if visible_end >= 0:
        key, last = np.arange(n)[None, :], (visible_end - t + np.arange(t))[:, None]
        seen = (key <= last) & ((key > last - window) if window else True)
        expected = np.where(seen[None], expected, -np.inf)
    expected = np.exp(expected - expected.max(axis=-1, keepdims=True))
    totals = np.empty((m, t), np.float32)
    elementwise.tile_softmax(scores, visible_end, window, np.empty(n, np.int32), totals)
    np.testing.assert_allclose(scores, expected, rtol=2e-6, atol=1e-30)
    np.testing.assert_allclose(totals, expected.sum(axis=-1), rtol=1e-5)


@pytest.mark.parametrize("n", [1, 7, 8, 9, 17, 100])
def test_row_max_is_the_maximum(n):
    from kernels.cpu import elementwise
    if not elementwise.available():
        pytest.skip("numba is not installed")
    rng = np.random.default_rng(n)
    for _ in range(20):
        row = rng.standard_normal(n).astype(np.float32)
        assert elementwise.row_max(row) == row.max()
