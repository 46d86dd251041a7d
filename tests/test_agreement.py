"""Agreement with llama.cpp on both bundled models: teacher-forced scoring and greedy decoding."""
from statistics import median

import pytest

from agreement import (MAX_LOGPROB_ERROR, MAX_MEDIAN_LOGPROB_ERROR, MIN_ARGMAX_AGREEMENT, Agreement,
                       greedy_prefix_to_check)
from conftest import MODELS, load_fixture
from shared.sampling_params import SamplingParams


_REPORTS: dict[tuple[str, str], Agreement] = {}


def teacher_forced(engines, model: str, kv_cache_dtype: str) -> Agreement:
    """The teacher-forced scores of every fixture case against the bar (computed once a session)."""
    if (model, kv_cache_dtype) not in _REPORTS:
        engine, report = engines(model, kv_cache_dtype), Agreement()
        for case in load_fixture(model)["generate"]:
            tokens = case["prompt_tokens"] + case["greedy_continuation"]
            report.add_case(case["teacher_forced"], engine.score(tokens, top_k=8))
        _REPORTS[model, kv_cache_dtype] = report
    return _REPORTS[model, kv_cache_dtype]


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("kv_cache_dtype", ["f16", pytest.param("q8_0", marks=pytest.mark.xfail(
    reason="q8_0's K/V flip a few of the reference's near-ties past the 0.5 margin (docs/BENCHMARKS.md, "
           "KV cache codecs); test_q8_0_kv_cache_keeps_the_aggregate_bar holds the rest", strict=False)),
    pytest.param("q4_0", marks=pytest.mark.xfail(reason="q4_0's K/V are only reported against the bar",
                                                 strict=False))])
def test_teacher_forced_scores_clear_the_bar(model, kv_cache_dtype, engines):
    """With the default f16 KV cache, llama.cpp's own; the quantized caches are reported (-s prints
    their figures) against references computed with f16."""
    report = teacher_forced(engines, model, kv_cache_dtype)
    print(model, kv_cache_dtype, report.summary())
    assert report.positions == sum(len(c["teacher_forced"]) for c in load_fixture(model)["generate"])
    assert report.passed, report.summary()


@pytest.mark.parametrize("model", MODELS)
def test_q8_0_kv_cache_keeps_the_aggregate_bar(model, engines):
    """q8_0's K/V against the f16 references: argmax agreement, the largest and the median logprob
    errors stay inside the bar (only single near-ties of the reference may flip)."""
    report = teacher_forced(engines, model, "q8_0")
    print(model, "q8_0", report.summary())
    assert report.rate >= MIN_ARGMAX_AGREEMENT, report.summary()
    assert max(report.position_errors) <= MAX_LOGPROB_ERROR, report.summary()
    assert median(report.position_errors) <= MAX_MEDIAN_LOGPROB_ERROR, report.summary()


@pytest.mark.parametrize("model", MODELS)
def test_greedy_generation_reproduces_llama_cpp(model, engines):
    engine = engines(model)
    cases = load_fixture(model)["generate"]
    # all prompts decoded together in packed batches, greedy, without stopping at EOS
    params = [SamplingParams(max_tokens=len(c["greedy_continuation"]), temperature=0.0, ignore_eos=True)
              for c in cases]
    outputs = engine.generate([c["prompt_tokens"] for c in cases], params)
    checked = 0
    for case, out in zip(cases, outputs):
        n = greedy_prefix_to_check(case)
        assert out.tokens[:n] == case["greedy_continuation"][:n], (
            f"{case['name']}: diverged before the first near-tie (checked {n} tokens)")
        matched = next((j for j, (a, b) in enumerate(zip(out.tokens, case["greedy_continuation"])) if a != b),
                       len(case["greedy_continuation"]))
        print(f"{model} {case['name']}: must match {n}, matches {matched} of {len(case['greedy_continuation'])}")
        checked += n
    assert checked > 0   # at least one case has a span before its first near-tie
