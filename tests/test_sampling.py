"""Tests for shared/sampling_params.py and worker/sampling.py.

Statistical tests use fixed seeds, so they are deterministic; the tolerances
are nevertheless chosen so that a correct sampler passes for (almost) any seed:

* total variation distance between empirical and expected distribution < 0.02
  with N = 20000 draws (the expected TVD of a correct sampler is ~0.005), and
* Pearson chi-square statistic below the 0.999 quantile of chi2(df)
  (i.e. the goodness-of-fit p-value is > 1e-3).
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from shared.sampling_params import SamplingParams
from worker.sampling import (
    Sampler,
    SampleOutput,
    apply_penalties,
    make_generator,
    truncated_distribution,
)

N_DRAWS = 20000
TVD_TOL = 0.02
# 0.999 quantiles of chi-square with df degrees of freedom (p-value 1e-3).
CHI2_999 = {1: 10.828, 2: 13.816, 3: 16.266, 4: 18.467, 5: 20.515, 6: 22.458,
            7: 24.322, 8: 26.124, 9: 27.877, 10: 29.588, 11: 31.264}

LOGITS8 = np.array([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, 1.5, 0.25], dtype=np.float32)


def softmax(x):
    x = np.asarray(x, dtype=np.float64)
    e = np.exp(x - x.max())
    return e / e.sum()


def draw_many(row, params, n=N_DRAWS, seed=0, prompt=(), output=()):
    """Sample ``n`` tokens from the same row (one batch of n identical rows)."""
    gen = make_generator(seed)
    logits = np.tile(np.asarray(row, np.float32), (n, 1))
    out = Sampler().sample(logits, [params] * n, [list(prompt)] * n,
                           [list(output)] * n, [gen] * n)
    return out.token_ids


def assert_matches(tokens, expected):
    """Empirical frequencies of ``tokens`` match distribution ``expected``."""
    expected = np.asarray(expected, dtype=np.float64)
    counts = np.bincount(tokens, minlength=expected.size).astype(np.float64)
    n = counts.sum()
    # Tokens with zero expected probability must never appear.
    assert counts[expected == 0].sum() == 0, f"impossible tokens drawn: {np.flatnonzero((expected == 0) & (counts > 0))}"
    emp = counts / n
    tvd = 0.5 * np.abs(emp - expected).sum()
    assert tvd < TVD_TOL, f"TVD {tvd:.4f} >= {TVD_TOL}"
    support = expected > 0
    exp_counts = expected[support] * n
    chi2 = float(((counts[support] - exp_counts) ** 2 / exp_counts).sum())
    df = int(support.sum()) - 1
    if df >= 1:
        assert chi2 < CHI2_999[df], f"chi2 {chi2:.2f} >= {CHI2_999[df]} (df={df})"


# ------------------------------------------------------------- distributions
def test_temperature_one_matches_softmax():
    toks = draw_many(LOGITS8, SamplingParams(temperature=1.0), seed=1)
    assert_matches(toks, softmax(LOGITS8))


def test_temperature_half_matches_scaled_softmax():
    toks = draw_many(LOGITS8, SamplingParams(temperature=0.5), seed=2)
    assert_matches(toks, softmax(LOGITS8 / 0.5))


def test_temperature_two_matches_scaled_softmax():
    toks = draw_many(LOGITS8, SamplingParams(temperature=2.0), seed=3)
    assert_matches(toks, softmax(LOGITS8 / 2.0))


def test_top_k_support_and_renormalized_frequencies():
    k = 3
    toks = draw_many(LOGITS8, SamplingParams(top_k=k), seed=4)
    best = np.argsort(-LOGITS8)[:k]          # ids 0, 6, 1
    assert set(np.unique(toks)) == set(best.tolist())
    expected = np.zeros(8)
    expected[best] = softmax(LOGITS8[best])
    assert_matches(toks, expected)


def test_top_k_larger_than_vocab_is_disabled():
    toks = draw_many(LOGITS8, SamplingParams(top_k=100), n=5000, seed=5)
    assert len(np.unique(toks)) == 8


def nucleus_probs(p_row, top_p):
    """Reference: the smallest prefix (by desc prob) with mass >= top_p, renormalized."""
    order = np.argsort(-p_row, kind="stable")
    cum = np.cumsum(p_row[order])
    keep = order[: int(np.searchsorted(cum, top_p, side="left")) + 1]
    out = np.zeros_like(p_row)
    out[keep] = p_row[keep] / p_row[keep].sum()
    return out


@pytest.mark.parametrize("top_p, kept", [(0.65, {0, 1}), (0.75, {0, 1, 2}), (0.3, {0}),
                                         (0.92, {0, 1, 2, 3}), (0.97, {0, 1, 2, 3, 4})])
def test_top_p_keeps_smallest_prefix_reaching_p(top_p, kept):
    probs = np.array([0.4, 0.3, 0.15, 0.1, 0.05])
    row = np.log(probs).astype(np.float32)
    toks = draw_many(row, SamplingParams(top_p=top_p), seed=6)
    assert set(np.unique(toks).tolist()) == kept
    assert_matches(toks, nucleus_probs(probs, top_p))


def test_top_p_applies_after_top_k_and_temperature():
    # temperature 0.5 -> top-k 4 -> top-p 0.9 on the renormalized top-4 mass.
    params = SamplingParams(temperature=0.5, top_k=4, top_p=0.9)
    scaled = LOGITS8 / 0.5
    best = np.argsort(-LOGITS8)[:4]
    p4 = np.zeros(8)
    p4[best] = softmax(scaled[best])
    expected = nucleus_probs(p4, 0.9)
    toks = draw_many(LOGITS8, params, seed=7)
    assert_matches(toks, expected)


def test_min_p_removes_tokens_below_threshold():
    probs = np.array([0.5, 0.2, 0.12, 0.09, 0.05, 0.04])
    row = np.log(probs).astype(np.float32)
    min_p = 0.2                                       # threshold 0.1 -> keep 0, 1, 2
    toks = draw_many(row, SamplingParams(min_p=min_p), seed=8)
    assert set(np.unique(toks).tolist()) == {0, 1, 2}
    expected = np.where(probs >= min_p * probs.max(), probs, 0.0)
    assert_matches(toks, expected / expected.sum())


def test_min_p_uses_temperature_scaled_distribution():
    probs = np.array([0.5, 0.2, 0.12, 0.09, 0.05, 0.04])
    row = np.log(probs).astype(np.float32)
    # At temperature 2 the ratios are sqrt'd: p_i/p_max = sqrt(probs/0.5).
    ids, _ = truncated_distribution(row / np.float32(2.0), 0, 1.0, 0.5)
    ratio = np.sqrt(probs / probs.max())
    assert set(ids.tolist()) == set(np.flatnonzero(ratio >= 0.5).tolist())


@pytest.mark.parametrize("vocab, top_k, top_p, min_p, scale", [
    (262144, 0, 0.9, 0.0, 3.0),     # top-p alone over a Gemma-sized vocabulary
    (262144, 0, 0.999, 0.0, 0.5),   # nearly flat: falls back to a full sort
    (50000, 0, 0.5, 0.0, 8.0),      # peaked: resolved within the top-256 candidates
    (50000, 40, 0.95, 0.0, 2.0),
    (50000, 1000, 0.8, 0.05, 4.0),
    (50000, 0, 1.0, 0.01, 4.0),
])
def test_truncation_matches_bruteforce_reference(vocab, top_k, top_p, min_p, scale):
    rng = np.random.default_rng(vocab + top_k)
    row = (rng.standard_normal(vocab) * scale).astype(np.float32)
    ids, w = truncated_distribution(row, top_k, top_p, min_p)
    # Reference with full sorts.
    order = np.lexsort((np.arange(vocab), -row))
    if 0 < top_k < vocab:
        order = order[:top_k]
    p = softmax(row[order])
    if top_p < 1.0:
        cum = np.cumsum(p)
        keep = int(np.searchsorted(cum - p, top_p, side="left"))
        order, p = order[:max(keep, 1)], p[:max(keep, 1)]
    if min_p > 0.0:
        mask = p >= min_p * p.max()
        order, p = order[mask], p[mask]
    assert set(ids.tolist()) == set(order.tolist())
    got = dict(zip(ids.tolist(), (w / w.sum()).tolist()))
    np.testing.assert_allclose([got[t] for t in order.tolist()], p / p.sum(), rtol=1e-6)


# ------------------------------------------------------------------ penalties
def test_repetition_penalty_exact_vllm_formula():
    row = np.array([2.0, -1.0, 3.0, 0.5, -2.0, 1.0], dtype=np.float32)
    params = SamplingParams(repetition_penalty=1.5)
    out = apply_penalties(row, params, prompt_tokens=[0, 1, 1], output_tokens=[4])
    expected = row.copy()
    expected[0] = 2.0 / 1.5       # positive: divided
    expected[1] = -1.0 * 1.5      # negative: multiplied (once, despite repeats)
    expected[4] = -2.0 * 1.5
    np.testing.assert_allclose(out, expected, rtol=1e-6)
    # The seen tokens' probabilities drop; unseen ones rise.
    p0, p1 = softmax(row), softmax(out)
    assert (p1[[0, 1, 4]] < p0[[0, 1, 4]]).all() and (p1[[2, 3, 5]] > p0[[2, 3, 5]]).all()
    # Input left untouched.
    assert row[0] == 2.0


def test_presence_frequency_openai_formula_output_only():
    row = np.zeros(6, dtype=np.float32)
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    out = apply_penalties(row, params, prompt_tokens=[5, 5, 5], output_tokens=[1, 2, 2, 2])
    counts = np.array([0, 1, 3, 0, 0, 0])
    expected = row - (counts * 0.25 + (counts > 0) * 0.5)
    np.testing.assert_allclose(out, expected, rtol=1e-6)
    assert out[5] == 0.0, "prompt tokens must not get presence/frequency penalties"


def test_negative_presence_penalty_encourages():
    row = np.zeros(4, dtype=np.float32)
    out = apply_penalties(row, SamplingParams(presence_penalty=-1.0), [], [3])
    assert out[3] == pytest.approx(1.0)


def test_penalties_shift_sampled_distribution():
    params = SamplingParams(repetition_penalty=1.3, frequency_penalty=0.4,
                            presence_penalty=0.2)
    prompt, output = [0, 3], [6, 6, 2]
    toks = draw_many(LOGITS8, params, seed=9, prompt=prompt, output=output)
    pen = LOGITS8.astype(np.float64).copy()
    for t in {0, 3, 6, 2}:
        pen[t] = pen[t] / 1.3 if pen[t] > 0 else pen[t] * 1.3
    pen[6] -= 2 * 0.4 + 0.2
    pen[2] -= 1 * 0.4 + 0.2
    assert_matches(toks, softmax(pen))


def test_greedy_uses_penalized_logits():
    row = np.array([[1.0, 2.0, 1.8, 0.0]], dtype=np.float32)
    s = Sampler()
    plain = s.sample(row, [SamplingParams(temperature=0)], [[]], [[]], [None])
    assert plain.token_ids[0] == 1
    pen = s.sample(row, [SamplingParams(temperature=0, repetition_penalty=1.2, logprobs=0)],
                   [[1]], [[]], [None])
    assert pen.token_ids[0] == 2          # 2.0 / 1.2 = 1.667 < 1.8
    # Logprob reported is still the raw one.
    assert pen.logprobs[0] == pytest.approx(np.log(softmax(row[0]))[2], abs=1e-5)


# --------------------------------------------------------------------- greedy
def test_greedy_is_argmax_with_lowest_id_tie_break():
    rng = np.random.default_rng(10)
    logits = rng.standard_normal((5, 1000)).astype(np.float32)
    logits[3, [17, 400, 999]] = 50.0      # ties -> lowest id
    params = [SamplingParams(temperature=0.0)] * 5
    gens = [make_generator(i) for i in range(5)]
    states = [g.bit_generator.state for g in gens]
    out = Sampler().sample(logits, params, [[]] * 5, [[]] * 5, gens)
    expected = logits.argmax(axis=1)
    expected[3] = 17
    np.testing.assert_array_equal(out.token_ids, expected)
    assert out.token_ids.dtype == np.int64
    # Greedy rows consume no randomness.
    assert [g.bit_generator.state for g in gens] == states


def test_plain_greedy_rows_take_the_backends_argmax_and_check_the_rows_it_flags():
    """An argmax computed with the logits (the CPU backend's replayed decode passes) is the greedy
    rows' token when every row is plain greedy; a row it flags (-1: NaN or infinity in the row) or
    a batch with other rows gets the sampler's own argmax and checks."""
    rng = np.random.default_rng(11)
    logits = rng.standard_normal((3, 300)).astype(np.float32)
    given = logits.argmax(axis=1)
    greedy = [SamplingParams(temperature=0.0)] * 3
    out = Sampler().sample(logits, greedy, [[]] * 3, [[]] * 3, [None] * 3, argmax=given)
    assert out.token_ids is given and np.isnan(out.logprobs).all()
    flagged = logits.copy()
    flagged[1, 7] = np.nan
    with pytest.raises(ValueError, match="logits row 1 has no finite maximum"):
        Sampler().sample(flagged, greedy, [[]] * 3, [[]] * 3, [None] * 3, argmax=np.array([given[0], -1, given[2]]))
    mixed = greedy[:2] + [SamplingParams(temperature=0.0, logprobs=1)]
    out = Sampler().sample(logits, mixed, [[]] * 3, [[]] * 3, [None] * 3, argmax=np.array([5, 6, 7]))
    np.testing.assert_array_equal(out.token_ids, given)     # not plain greedy: its own argmax
    assert np.isfinite(out.logprobs[2])


def test_mixed_batch_greedy_and_sampled():
    logits = np.tile(LOGITS8, (4, 1))
    logits[2, 5] = 100.0   # row 2 sampled but effectively deterministic
    params = [SamplingParams(temperature=0), SamplingParams(top_k=1),
              SamplingParams(temperature=0.7), SamplingParams(temperature=0)]
    out = Sampler().sample(logits, params, [[]] * 4, [[]] * 4,
                           [make_generator(i) for i in range(4)])
    assert out.token_ids.tolist() == [0, 0, 5, 0]


# ---------------------------------------------------------------- determinism
def _generate(seed_rows, steps, vocab=512):
    """Run ``steps`` decode steps for a batch; returns the token list per row key.

    ``seed_rows`` is a list of (key, SamplingParams); the logits of a row at a
    step depend only on (key, step), as for a real model.
    """
    sampler = Sampler()
    gens = {key: make_generator(p.seed) for key, p in seed_rows}
    outputs = {key: [] for key, _ in seed_rows}
    for step in range(steps):
        logits = np.stack([
            np.random.default_rng([key, step]).standard_normal(vocab).astype(np.float32)
            for key, _ in seed_rows
        ])
        out = sampler.sample(
            logits, [p for _, p in seed_rows], [[1, 2, 3]] * len(seed_rows),
            [outputs[key] for key, _ in seed_rows], [gens[key] for key, _ in seed_rows])
        for (key, _), t in zip(seed_rows, out.token_ids.tolist()):
            outputs[key].append(t)
    return outputs


def test_same_seed_same_tokens_regardless_of_batch():
    target = SamplingParams(seed=1234, temperature=0.9, top_p=0.95, top_k=200,
                            frequency_penalty=0.3)
    alone = _generate([(7, target)], steps=24)[7]
    others = [
        (11, SamplingParams(seed=99)),
        (12, SamplingParams(temperature=0)),
        (13, SamplingParams(top_k=5, temperature=1.5)),
        (14, SamplingParams()),                      # unseeded
    ]
    batch_a = _generate([others[0], (7, target), others[1]], steps=24)[7]
    batch_b = _generate([others[3], others[2], others[1], others[0], (7, target)], steps=24)[7]
    assert alone == batch_a == batch_b
    assert len(set(alone)) > 5                       # really random, not greedy-like


def test_different_seeds_differ():
    a = _generate([(7, SamplingParams(seed=1))], steps=24)[7]
    b = _generate([(7, SamplingParams(seed=2))], steps=24)[7]
    c = _generate([(7, SamplingParams(seed=1))], steps=24)[7]
    assert a == c
    assert a != b


def test_make_generator_negative_and_none():
    assert make_generator(-1).random() == make_generator(-1).random()
    assert make_generator(None).random() != make_generator(None).random()


# ------------------------------------------------------------------- logprobs
def test_logprobs_chosen_and_top_n():
    rng = np.random.default_rng(11)
    vocab = 3000
    logits = (rng.standard_normal((3, vocab)) * 2).astype(np.float32)
    logits[1, [5, 6]] = 9.0  # a tie among the top entries -> lowest id first
    params = [
        SamplingParams(temperature=0.8, top_k=50, repetition_penalty=1.4, logprobs=5),
        SamplingParams(temperature=0, logprobs=20),
        SamplingParams(temperature=1.2, logprobs=None),
    ]
    out = Sampler().sample(logits, params, [[1, 2], [], []], [[3], [], []],
                           [make_generator(i) for i in range(3)])
    assert isinstance(out, SampleOutput)
    assert out.logprobs.dtype == np.float32 and out.logprobs.shape == (3,)
    for i in range(3):
        ref = np.log(softmax(logits[i]))   # raw distribution, no penalties/temperature
        n = params[i].logprobs
        if n is None:                      # not requested: not computed (vLLM's rule)
            assert math.isnan(float(out.logprobs[i]))
            assert out.top_ids[i] is None and out.top_logprobs[i] is None
            continue
        assert out.logprobs[i] == pytest.approx(ref[out.token_ids[i]], abs=1e-5)
        exp_ids = np.lexsort((np.arange(vocab), -logits[i]))[:n]
        np.testing.assert_array_equal(out.top_ids[i], exp_ids)
        np.testing.assert_allclose(out.top_logprobs[i], ref[exp_ids], atol=1e-5)
        assert np.all(np.diff(out.top_logprobs[i]) <= 0), "top logprobs not sorted best first"
    assert out.top_ids[1][:2].tolist() == [5, 6]


def test_logprobs_zero_returns_empty_top_list():
    out = Sampler().sample(LOGITS8[None], [SamplingParams(logprobs=0)], [[]], [[]],
                           [make_generator(0)])
    assert out.top_ids[0].shape == (0,) and out.top_logprobs[0].shape == (0,)
    assert math.isfinite(float(out.logprobs[0]))


def test_rejects_nan_logits_and_mismatched_lengths():
    bad = LOGITS8.copy()[None]
    bad[0, 2] = np.nan
    with pytest.raises(ValueError, match="row 0"):
        Sampler().sample(bad, [SamplingParams()], [[]], [[]], [None])
    # rows that skip the log-sum-exp (no logprobs asked) are checked all the same
    for value in (np.nan, np.inf):
        bad = np.stack([LOGITS8, LOGITS8, LOGITS8])
        bad[2, 5] = value
        for p in (SamplingParams(temperature=0), SamplingParams(temperature=0.7),
                  SamplingParams(temperature=0, logprobs=2)):
            with pytest.raises(ValueError, match="logits row 2 has no finite maximum"):
                Sampler().sample(bad, [SamplingParams(logprobs=1), SamplingParams(temperature=0), p],
                                 [[]] * 3, [[]] * 3, [make_generator(0)] * 3)
    all_neg = np.full((1, 8), -np.inf, np.float32)
    with pytest.raises(ValueError, match="row 0"):
        Sampler().sample(all_neg, [SamplingParams(temperature=0)], [[]], [[]], [None])
    with pytest.raises(ValueError, match="params"):
        Sampler().sample(LOGITS8[None], [], [[]], [[]], [None])


# ----------------------------------------------------------------- validation
@pytest.mark.parametrize("kwargs, name", [
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": 1.5}, "max_tokens"),
    ({"temperature": -0.1}, "temperature"),
    ({"temperature": 2.5}, "temperature"),
    ({"temperature": float("nan")}, "temperature"),
    ({"top_k": -2}, "top_k"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.01}, "top_p"),
    ({"min_p": -0.1}, "min_p"),
    ({"min_p": 1.5}, "min_p"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"repetition_penalty": float("inf")}, "repetition_penalty"),
    ({"repetition_penalty": 5e-324}, "repetition_penalty"),
    ({"top_k": 27791255271094183289692560484728832}, "top_k"),      # past int32: schemathesis found a 500
    ({"seed": 2**64}, "seed"),
    ({"max_tokens": 2**63}, "max_tokens"),
    ({"stop_token_ids": (2**63,)}, "stop_token_ids"),      # 0 in float32: +inf logits (schemathesis found it)
    ({"presence_penalty": 2.1}, "presence_penalty"),
    ({"frequency_penalty": -2.5}, "frequency_penalty"),
    ({"logprobs": -1}, "logprobs"),
    ({"logprobs": 21}, "logprobs"),
    ({"seed": 1.5}, "seed"),
    ({"stop_token_ids": (1, -3)}, "stop_token_ids"),
])
def test_validate_rejects_bad_values(kwargs, name):
    with pytest.raises(ValueError, match=name):
        SamplingParams(**kwargs).validate()


def test_validate_accepts_edges_and_greedy_flag():
    for p in [SamplingParams(), SamplingParams(temperature=0, top_k=-1, top_p=1.0),
              SamplingParams(temperature=2, top_k=1, top_p=1e-3, min_p=1.0,
                             repetition_penalty=0.5, presence_penalty=-2,
                             frequency_penalty=2, logprobs=20, seed=-5,
                             stop_token_ids=[1, 2], max_tokens=1)]:
        p.validate()
    assert SamplingParams(temperature=0).greedy
    assert not SamplingParams(temperature=0.1).greedy
    assert SamplingParams(stop_token_ids=[3, 4]).stop_token_ids == (3, 4)
    hash(SamplingParams(stop_token_ids=[3]))   # frozen + hashable
