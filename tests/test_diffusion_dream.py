"""The dream architecture (qwen2 blocks with Q/K/V biases, NEOX RoPE, bidirectional attention,
shifted logits) on a tiny GGUF written here with the gguf package, against an independent numpy
forward of the same weights."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFWriter

from shared.diffusion_params import DiffusionParams
from shared.step import DiffusionStep, SeqChunk, StepRequest
from worker.model_runner import ModelRunner

D, HEADS, KV_HEADS, FF, VOCAB, LAYERS, EPS, BASE = 32, 4, 2, 48, 40, 2, 1e-6, 10000.0
HEAD = D // HEADS
MASK = VOCAB - 1


def _weights(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    mat = lambda out, inp: (rng.standard_normal((out, inp)) / np.sqrt(inp)).astype(np.float32)  # noqa: E731
    vec = lambda n, s=0.1: (s * rng.standard_normal(n)).astype(np.float32)  # noqa: E731
    w = {"token_embd.weight": mat(VOCAB, D), "output_norm.weight": 1 + vec(D), "output.weight": mat(VOCAB, D)}
    for i in range(LAYERS):
        p = f"blk.{i}."
        w.update({p + "attn_norm.weight": 1 + vec(D), p + "ffn_norm.weight": 1 + vec(D),
                  p + "attn_q.weight": mat(HEADS * HEAD, D), p + "attn_q.bias": vec(HEADS * HEAD, 0.5),
                  p + "attn_k.weight": mat(KV_HEADS * HEAD, D), p + "attn_k.bias": vec(KV_HEADS * HEAD, 0.5),
                  p + "attn_v.weight": mat(KV_HEADS * HEAD, D), p + "attn_v.bias": vec(KV_HEADS * HEAD, 0.5),
                  p + "attn_output.weight": mat(D, HEADS * HEAD),
                  p + "ffn_gate.weight": mat(FF, D), p + "ffn_up.weight": mat(FF, D),
                  p + "ffn_down.weight": mat(D, FF)})
    return w


def write_tiny_dream(path: Path, weights: dict[str, np.ndarray]) -> Path:
    w = GGUFWriter(str(path), "dream")
    w.add_name("tiny-dream")
    for key, value in {"context_length": 128, "embedding_length": D, "block_count": LAYERS, "feed_forward_length": FF,
                       "attention.head_count": HEADS, "attention.head_count_kv": KV_HEADS,
                       "rope.dimension_count": HEAD, "vocab_size": VOCAB}.items():
        w.add_uint32(f"dream.{key}", value)
    w.add_float32("dream.attention.layer_norm_rms_epsilon", EPS)
    w.add_float32("dream.rope.freq_base", BASE)
    w.add_uint32("tokenizer.ggml.mask_token_id", MASK)       # no diffusion.shift_logits: Dream's default, shifted
    for name, data in weights.items():
        w.add_tensor(name, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def reference_logits(w: dict[str, np.ndarray], tokens: list[int]) -> np.ndarray:
    """Row i of one non-causal pass, in float64: qwen2's block as written in its paper/HF code."""
    def norm(x, g):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + EPS) * g

    def rope_neox(x, pos):          # [n, heads, HEAD]: the two halves of each head rotate together
        half = HEAD // 2
        theta = pos[:, None] * BASE ** (-np.arange(half) * 2.0 / HEAD)
        cos, sin = np.cos(theta)[:, None], np.sin(theta)[:, None]
        a, b = x[..., :half], x[..., half:]
        return np.concatenate([a * cos - b * sin, a * sin + b * cos], -1)

    w = {k: v.astype(np.float64) for k, v in w.items()}
    n = len(tokens)
    pos = np.arange(n, dtype=np.float64)
    x = w["token_embd.weight"][tokens]
    for i in range(LAYERS):
        p = f"blk.{i}."
        h = norm(x, w[p + "attn_norm.weight"])
        q = (h @ w[p + "attn_q.weight"].T + w[p + "attn_q.bias"]).reshape(n, HEADS, HEAD)
        k = (h @ w[p + "attn_k.weight"].T + w[p + "attn_k.bias"]).reshape(n, KV_HEADS, HEAD)
        v = (h @ w[p + "attn_v.weight"].T + w[p + "attn_v.bias"]).reshape(n, KV_HEADS, HEAD)
        q, k = rope_neox(q, pos), rope_neox(k, pos)
        k, v = np.repeat(k, HEADS // KV_HEADS, axis=1), np.repeat(v, HEADS // KV_HEADS, axis=1)
        scores = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(HEAD)          # every query sees every key
        scores = np.exp(scores - scores.max(-1, keepdims=True))
        scores /= scores.sum(-1, keepdims=True)
        attn = np.einsum("hqk,khd->qhd", scores, v).reshape(n, D)
        x = x + attn @ w[p + "attn_output.weight"].T
        h = norm(x, w[p + "ffn_norm.weight"])
        gate, up = h @ w[p + "ffn_gate.weight"].T, h @ w[p + "ffn_up.weight"].T
        x = x + (gate / (1 + np.exp(-gate)) * up) @ w[p + "ffn_down.weight"].T
    return norm(x, w["output_norm.weight"]) @ w["output.weight"].T


@pytest.fixture(scope="module")
def dream(tmp_path_factory):
    weights = _weights()
    path = write_tiny_dream(tmp_path_factory.mktemp("dream") / "tiny-dream.gguf", weights)
    return ModelRunner(path), weights


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def test_dream_forward_matches_numpy_and_its_logits_are_shifted(dream):
    runner, weights = dream
    assert runner.config.architecture == "dream" and not runner.config.causal
    assert runner.config.shift_logits and runner.config.rope_neox and runner.config.mask_token_id == MASK
    tokens = [3, 17, 5, 30, MASK, MASK, 8, MASK, MASK, 2, MASK]
    ref = _log_softmax(reference_logits(weights, tokens))
    chunk = SeqChunk(1, np.array(tokens), 0, np.zeros(0, np.int32), len(tokens), sample=False, score_top_k=VOCAB)
    res = runner.execute(StepRequest([chunk])).results[0]
    got = np.full((len(tokens), VOCAB), np.nan)
    for i in range(len(tokens)):
        got[i, res.score_ids[i]] = res.score_logprobs[i]
    # position i's prediction is row i - 1's (row 0's for position 0)
    shifted = ref[[0] + list(range(len(tokens) - 1))]
    np.testing.assert_allclose(got, shifted, atol=2e-4)
    assert not np.allclose(got[1:], ref[1:], atol=1e-2)      # it really is shifted


def test_dream_commits_from_the_shifted_rows(dream):
    runner, weights = dream
    prompt = [3, 17, 5, 30]
    canvas = prompt + [MASK] * 4
    ref = reference_logits(weights, canvas)
    params = DiffusionParams(gen_length=4, steps=1, block_length=4, algorithm="confidence")
    chunk = SeqChunk(2, np.array(canvas), 0, np.zeros(0, np.int32), len(prompt), sample=False,
                     diffusion=DiffusionStep(4, 8, 4, params))
    res = runner.execute(StepRequest([chunk])).results[0]
    committed = dict(zip(res.committed_positions.tolist(), res.committed_ids.tolist()))
    assert committed == {pos: int(np.argmax(ref[pos - 1])) for pos in range(4, 8)}
