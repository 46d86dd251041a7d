"""Speculative decoding through `tensorserve serve --speculative ngram`: the HTTP API's greedy
output is the in-process plain output, `speculative: false` turns it off per request, and
/metrics counts drafted and accepted tokens and shows the cost governor's state."""
from __future__ import annotations

import re
import sys

import httpx

from processes import start_with_ready_file, stop
from shared.sampling_params import SamplingParams

PARAGRAPH = ("The lighthouse keeper climbed the spiral stairs every evening at dusk, carrying a small brass "
             "lamp and a notebook in which he wrote the color of the sea, the direction of the wind, and "
             "the names of the ships that passed the rocks below.")
PROMPT = f"Repeat the paragraph exactly.\n\nParagraph: {PARAGRAPH}\n\nRepeated: {PARAGRAPH[:40]}"


def metric(text: str, name: str) -> float:
    found = re.search(rf"^{name} ([0-9.e+-]+)$", text, re.M)
    assert found, f"{name} not in /metrics"
    return float(found.group(1))


def test_served_greedy_output_equals_plain_and_metrics_count_acceptance(tmp_path, engines):
    ready = tmp_path / "serve.json"
    proc, info = start_with_ready_file(
        [sys.executable, "-m", "tensorserve", "serve", "--http-port", "0", "--grpc-port", "0", "--kv-memory",
         "96MiB", "--grace-period", "5", "--ready-file", str(ready), "--speculative", "ngram",
         "--num-speculative-tokens", "4"], ready, tmp_path / "serve.log", timeout=180, name="serve")
    try:
        local = engines("smollm2-135m")
        from router.tokenizer import Tokenizer
        tokenizer = Tokenizer.from_metadata(local.runner.gguf.metadata)
        ids = tokenizer.encode(PROMPT)
        expected = local.generate([ids], SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True))[0].tokens
        base = f"http://{info['http']}"
        with httpx.Client(timeout=120) as client:
            def complete(**extra) -> str:
                r = client.post(f"{base}/v1/completions", json={"model": "smollm2-135m", "prompt": ids,
                                                                 "max_tokens": 32, "temperature": 0,
                                                                 "ignore_eos": True, **extra})
                assert r.status_code == 200, r.text
                return r.json()["choices"][0]["text"]

            assert complete() == tokenizer.decode(expected)
            metrics = client.get(f"{base}/metrics").text
            drafted = metric(metrics, "tensorserve_spec_decode_num_draft_tokens_total")
            accepted = metric(metrics, "tensorserve_spec_decode_num_accepted_tokens_total")
            assert 0 < accepted <= drafted
            assert metric(metrics, "tensorserve_spec_decode_num_drafts_total") > 0
            assert metric(metrics, "tensorserve_spec_decode_mean_acceptance_length") > 2
            # the cost governor (on by default) shows its state per range of batch sizes
            states = re.findall(r'^tensorserve_spec_decode_governor_state\{batch_size_range="1",state="(\w+)"\} '
                                r'1\.0$', metrics, re.M)
            assert len(states) == 1 and states[0] in ("probing", "drafting", "paused"), states
            assert re.search(r'^tensorserve_spec_decode_governor_drafting\{batch_size_range="32\+"\} 0\.0$',
                             metrics, re.M)     # never used: probing, plain steps first
            assert re.search(r'^tensorserve_spec_decode_governor_pauses_total\{batch_size_range="1"\} ', metrics,
                             re.M)

            assert complete(speculative=False) == tokenizer.decode(expected)
            again = client.get(f"{base}/metrics").text
            assert metric(again, "tensorserve_spec_decode_num_draft_tokens_total") == drafted
            r = client.post(f"{base}/v1/completions", json={"model": "smollm2-135m", "prompt": "hi",
                                                             "speculative": "no"})
            assert r.status_code == 400 and "speculative" in r.text
    finally:
        stop(proc, timeout=60)
