"""The pure parts of loadtest/bench_serving.py: SSE parsing, the summary, prompt generation. No server."""
import importlib.util
import random
import sys
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location(
    "bench_serving", Path(__file__).resolve().parents[1] / "loadtest" / "bench_serving.py")
bs = importlib.util.module_from_spec(_spec)
sys.modules["bench_serving"] = bs         # dataclasses look their module up there
_spec.loader.exec_module(bs)


def test_parse_sse_line():
    assert bs.parse_sse_line('data: {"choices": [{"text": "hi"}]}\n') == {"choices": [{"text": "hi"}]}
    assert bs.parse_sse_line('data:{"a": 1}') == {"a": 1}
    assert bs.parse_sse_line("data: [DONE]") == bs.DONE
    assert bs.parse_sse_line('error: {"message": "boom"}') == {"error": {"message": "boom"}}
    for line in ("", "   ", ": keep-alive", "event: message", "id: 3"):
        assert bs.parse_sse_line(line) is None
    with pytest.raises(ValueError):
        bs.parse_sse_line("data: {not json")


def _result(sent, times, usage=None, error=None):
    return bs.Result(sent=sent, chunk_times=list(times), usage=usage, error=error)


def test_result_properties():
    r = _result(10.0, [10.5, 10.6, 10.8])
    assert r.ttft == pytest.approx(0.5)
    assert r.itls == pytest.approx([0.1, 0.2])
    assert r.output_tokens == 3                       # no usage: one token per chunk
    assert r.cached_tokens is None
    r.usage = {"prompt_tokens": 100, "completion_tokens": 7, "prompt_tokens_details": {"cached_tokens": 64}}
    assert r.output_tokens == 7 and r.cached_tokens == 64


def test_summarize():
    results = [_result(0.0, [1.0, 1.1, 1.3], {"prompt_tokens": 100, "completion_tokens": 3}),
               _result(0.0, [2.0, 2.4], {"prompt_tokens": 120, "completion_tokens": 2}),
               _result(0.0, [], error="HTTP 503: overloaded"),
               _result(0.0, [], error="HTTP 503: overloaded")]
    s = bs.summarize(results, duration=2.5)
    assert (s["requests"], s["failed"], s["output_tokens"]) == (4, 2, 5)
    assert s["output_tok_s"] == pytest.approx(2.0)
    assert s["ttft_p50_s"] == pytest.approx(1.5)
    assert s["ttft_p99_s"] == pytest.approx(1.0 + 0.99 * 1.0)     # numpy linear interpolation
    assert s["itl_p50_s"] == pytest.approx(0.2)                   # samples 0.1, 0.2, 0.4
    assert s["itl_p99_s"] == pytest.approx(0.2 + 0.98 * 0.2)
    assert s["mean_prompt_tokens"] == 110
    assert s["errors"] == ["HTTP 503: overloaded"]


def test_summarize_all_failed():
    s = bs.summarize([_result(0.0, [], error="x")], duration=1.0)
    assert s["failed"] == 1 and s["output_tok_s"] == 0 and s["ttft_p50_s"] is None and s["itl_p99_s"] is None


def test_prompts_distinct_and_sized():
    prompts = bs.make_prompts(random.Random(0), 64, 100)
    assert all(len(p.split()) == 100 for p in prompts)
    assert len({p.split()[0] for p in prompts}) == 64
    assert len({p.split()[1] for p in prompts}) > 1     # random words after the head, not a fixed text
    assert bs.make_prompts(random.Random(1), 8, 100) != bs.make_prompts(random.Random(2), 8, 100)
    assert len(bs.WORDS) >= 300 and all(w.islower() and w.isalpha() for w in bs.WORDS)


def test_compare_reports_the_issue_targets():
    spec = importlib.util.spec_from_file_location(
        "compare_serving", Path(__file__).resolve().parents[1] / "loadtest" / "compare_serving.py")
    compare_serving = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(compare_serving)
    level = {"output_tok_s": 100.0, "ttft_p50_s": 1.0, "ttft_p99_s": 2.0, "itl_p50_s": 0.1, "itl_p99_s": 0.4}
    ours = {"c32": dict(level, output_tok_s=140.0), "c1": level,
            "shared_prefix": {"ttft_cold_s": 2.0, "ttft_warm_s": 0.09, "warm_over_cold": 0.045}}
    peer = {"c32": dict(level, itl_p99_s=1.0), "c1": level,
            "shared_prefix": {"ttft_cold_s": 4.0, "ttft_warm_s": 0.08, "warm_over_cold": 0.02}}
    out = compare_serving.compare(ours, peer)
    assert "| 32 | 140.0 / 100.0 (1.40x)" in out and out.index("| 1 |") < out.index("| 32 |")
    assert "met: c32 output tok/s >= 1.3x" in out and "met: c32 ITL p99 <= 0.5x" in out
    assert "NOT met: warm TTFT <= peer's" in out and "met: warm TTFT <= 0.05x our cold" in out
