"""Agreement with llama.cpp on both bundled models: teacher-forced scoring and greedy decoding."""
import pytest

from agreement import Agreement, greedy_prefix_to_check
from conftest import MODELS, load_fixture
from shared.sampling_params import SamplingParams


@pytest.mark.parametrize("model", MODELS)
def test_teacher_forced_scores_clear_the_bar(model, engines):
    engine = engines(model)
    report = Agreement()
    for case in load_fixture(model)["generate"]:
        tokens = case["prompt_tokens"] + case["greedy_continuation"]
        report.add_case(case["teacher_forced"], engine.score(tokens, top_k=8))
    print(model, report.summary())
    assert report.positions == sum(len(c["teacher_forced"]) for c in load_fixture(model)["generate"])
    assert report.passed, report.summary()


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
