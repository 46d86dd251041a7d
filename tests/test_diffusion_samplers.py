"""The diffusion samplers (worker/diffusion/) on logits small enough to check by hand: which masked
positions a step commits, how many, with which tokens, ties to the lower position; and the
temperature/top-k/top-p/seed behaviour of the sampler chain."""
from __future__ import annotations

import numpy as np
import pytest

from shared.diffusion_params import DiffusionParams
from worker.diffusion import DiffusionRandom, sampler_for
from worker.diffusion.base import MersenneTwister, draw_positions


def _logits_for(probabilities: list[list[float]]) -> np.ndarray:
    return np.log(np.array(probabilities, np.float64)).astype(np.float32)


# four masked positions over a vocabulary of 4; each row's argmax, probability, entropy and margin
# are read off directly
LOGITS = _logits_for([
    [0.40, 0.30, 0.20, 0.10],     # pos 0: token 0, p .40, high entropy, margin .10
    [0.05, 0.90, 0.03, 0.02],     # pos 1: token 1, p .90, low entropy, margin .85
    [0.10, 0.10, 0.50, 0.30],     # pos 2: token 2, p .50, margin .20
    [0.05, 0.90, 0.03, 0.02],     # pos 3: the same as pos 1 (a tie: pos 1 first)
])


def _commit(algorithm: str, count: int = -1, logits: np.ndarray = LOGITS, seed: int = 0, **kw):
    params = DiffusionParams(algorithm=algorithm, seed=seed, **kw)
    chosen, tokens = sampler_for(algorithm).commit(logits, count, params, DiffusionRandom(seed))
    return chosen.tolist(), tokens.tolist()


def test_temperature_zero_draws_argmax_and_full_vocabulary_softmax():
    draws = draw_positions(LOGITS, DiffusionParams(), DiffusionRandom(0))
    assert draws.tokens.tolist() == [0, 1, 2, 1]
    np.testing.assert_allclose(draws.probability, [0.40, 0.90, 0.50, 0.90], rtol=1e-5)
    np.testing.assert_allclose(draws.margin, [0.10, 0.85, 0.20, 0.85], rtol=1e-4)
    p = np.exp(LOGITS.astype(np.float64))
    np.testing.assert_allclose(draws.entropy, -(p * np.log(p)).sum(axis=1), rtol=1e-4)


def test_confidence_commits_the_most_probable_ties_lower_position_first():
    assert _commit("confidence", 1) == ([1], [1])
    assert _commit("confidence", 2) == ([1, 3], [1, 1])
    assert _commit("confidence", 3) == ([1, 3, 2], [1, 1, 2])
    assert _commit("confidence", 0) == ([], [])


def test_entropy_commits_the_lowest_entropy_first():
    assert _commit("entropy", 3) == ([1, 3, 2], [1, 1, 2])     # pos 0 (flattest) last


def test_margin_commits_the_widest_margin_first():
    assert _commit("margin", 4) == ([1, 3, 2, 0], [1, 1, 2, 0])


def test_top_k_one_makes_every_confidence_one_so_left_to_right():
    # llama.cpp's fixture runs (--top-k 1): every candidate list has one token of probability 1
    assert _commit("confidence", 2, top_k=1) == ([0, 1], [0, 1])
    assert _commit("margin", 3, top_k=1) == ([0, 1, 2], [0, 1, 2])


def test_mersenne_twister_is_std_mt19937():
    # the C++ standard: the 10000th draw of a default-seeded (5489) std::mt19937 is 4123659995
    mt = MersenneTwister(5489)
    mt._bits.random_raw(9999)
    assert int(mt._bits.random_raw()) == 4123659995
    first = MersenneTwister(5489).uniform_float()
    assert first == float(np.float32(3499211612) / np.float32(2**32))


def test_random_ranks_by_uniform_draws_of_the_seed():
    for seed in (0, 1, 7):
        mt = MersenneTwister(seed)
        draws = np.array([mt.uniform_float() for _ in range(4)], np.float32)
        expected = sorted(range(4), key=lambda i: (-draws[i], i))[:2]
        chosen, tokens = _commit("random", 2, seed=seed)
        assert chosen == expected and tokens == [[0, 1, 2, 1][i] for i in expected]
        assert _commit("random", 2, seed=seed) == (chosen, tokens)


def test_origin_commits_each_position_with_probability_count_over_masked():
    assert _commit("origin", 4) == ([0, 1, 2, 3], [0, 1, 2, 1])     # p_transfer 1
    assert _commit("origin", 0) == ([], [])                         # p_transfer 0
    seed = 3
    mt = MersenneTwister(seed)
    coins = [mt.uniform_float() < 0.5 for _ in range(4)]
    chosen, _ = _commit("origin", 2, seed=seed)
    assert chosen == [i for i in range(4) if coins[i]]


def test_low_confidence_commits_every_position_over_the_threshold_at_least_one():
    assert _commit("low_confidence", threshold=0.5) == ([1, 2, 3], [1, 2, 1])      # p >= threshold
    assert _commit("low_confidence", threshold=0.9) == ([1, 3], [1, 1])
    assert _commit("low_confidence", threshold=0.95) == ([1], [1])                 # none: the best one


def test_entropy_bound_commits_lowest_entropies_within_gamma_at_least_one():
    p = np.exp(LOGITS.astype(np.float64))
    h = -(p * np.log(p)).sum(axis=1)                    # pos 1 = pos 3 < pos 2 < pos 0
    assert _commit("entropy_bound", gamma=2 * h[1] + 1e-4) == ([1, 3], [1, 1])
    assert _commit("entropy_bound", gamma=2 * h[1] + h[2] + 1e-4) == ([1, 3, 2], [1, 1, 2])
    assert _commit("entropy_bound", gamma=0.0) == ([1], [1])                       # at least one
    assert _commit("entropy_bound", gamma=100.0)[0] == [1, 3, 2, 0]


def test_temperature_sampling_is_seeded_and_top_k_top_p_bound_it():
    rng = np.random.default_rng(0)
    flat = rng.normal(0, 0.1, size=(24, 50)).astype(np.float32)       # near-uniform: draws vary
    hot = dict(temperature=1.0)
    a = _commit("confidence", 24, logits=flat, seed=11, **hot)
    assert a == _commit("confidence", 24, logits=flat, seed=11, **hot)       # same seed, same draws
    assert a[1] != _commit("confidence", 24, logits=flat, seed=12, **hot)[1]
    assert sorted(a[0]) == list(range(24))
    argmax = np.argmax(flat, axis=1)
    for kw in ({"top_k": 1}, {"top_p": 1e-6}):          # one candidate left: the argmax, whatever the seed
        chosen, tokens = _commit("confidence", 24, logits=flat, seed=5, **hot, **kw)
        assert tokens == argmax[chosen].tolist()
        assert chosen == list(range(24))                # every confidence 1: left to right
    top3 = np.argsort(-flat, axis=1)[:, :3]
    chosen, tokens = _commit("confidence", 24, logits=flat, seed=5, top_k=3, **hot)
    assert all(t in top3[c] for c, t in zip(chosen, tokens))
    assert len(set(tokens)) > 1


def test_unknown_algorithm_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown diffusion algorithm"):
        sampler_for("greedy")
