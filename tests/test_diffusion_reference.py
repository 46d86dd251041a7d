"""Text diffusion against llama.cpp: the tiny LLaDA fixture (tests/fixtures/diffusion/README.md).
Scoring reproduces its `forward` canvases (one non-causal pass, each position's own logits) and
`tensorserve diffuse` its `cli` runs of llama-diffusion-cli, token for token."""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from conftest import FIXTURES
from shared.diffusion_params import DiffusionParams
from tensorserve.local import LocalEngine

MODEL = FIXTURES / "diffusion" / "tiny-llada.gguf"
REFERENCE = json.loads((FIXTURES / "diffusion" / "tiny-llada.json").read_text())


@pytest.fixture(scope="module")
def llada() -> LocalEngine:
    return LocalEngine(MODEL)


def _check_scores(scores: list[dict], canvas: dict) -> float:
    assert len(scores) == len(canvas["tokens"])
    worst = 0.0
    for got, ref in zip(scores, canvas["positions"]):
        assert got["top_ids"] == ref["top_ids"]          # every argmax, and the whole top 8 in order
        expected = np.array(ref["top_logits"]) - ref["logsumexp"]
        worst = max(worst, float(np.abs(np.array(got["top_logprobs"]) - expected).max()))
    assert worst < 1e-3
    return worst


def test_score_matches_every_forward_canvas(llada):
    assert llada.is_diffusion and llada.config.mask_token_id == REFERENCE["mask_token_id"] == 49152
    assert not llada.config.shift_logits
    for canvas in REFERENCE["forward"]:
        _check_scores(llada.score(canvas["tokens"], top_k=8), canvas)


def test_score_cli_on_a_diffusion_model(tmp_path):
    canvas = REFERENCE["forward"][1]        # a canvas with committed tokens among the masks
    path = tmp_path / "tokens.json"
    path.write_text(json.dumps(canvas["tokens"]))
    out = subprocess.run([sys.executable, "-m", "tensorserve", "score", "--model", str(MODEL), "--tokens-json",
                          str(path), "--top-k", "8"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    _check_scores(json.loads(out.stdout), canvas)


def _params(run: dict) -> DiffusionParams:
    # llama.cpp's -ub is the whole canvas, prompt included
    return DiffusionParams(gen_length=run["n_ubatch"] - len(run["prompt_tokens"]), steps=run["steps"],
                           block_length=run["block_length"], algorithm=run["algorithm"], top_k=run["top_k"])


def test_every_cli_run_in_process(llada):
    for run in REFERENCE["cli"]:
        rendered = llada.tokenizer.encode(run["rendered_prompt"], add_special=True, parse_special=True)
        assert rendered == run["prompt_tokens"]
        output = llada.diffuse([run["prompt_tokens"]], _params(run))[0]
        assert llada.tokenizer.decode(output) == run["output_text"], run


def test_cli_runs_as_llama_diffusion_cli():
    run = REFERENCE["cli"][2]                    # block 4: several blocks of several steps
    p = _params(run)
    out = subprocess.run([sys.executable, "-m", "tensorserve", "diffuse", "--model", str(MODEL), "--chat",
                          "--prompt", run["prompt_text"], "--gen-length", str(p.gen_length), "--steps", str(p.steps),
                          "--block-length", str(p.block_length), "--algorithm", p.algorithm, "--top-k", str(p.top_k)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout == run["output_text"] + "\n"
