"""Diffusion batching (scheduler/diffusion/): concurrent requests of different prompts, lengths,
seeds and algorithms, joining at different steps, share each forward and still get exactly what
each gets alone; a canvas's logits are bit-identical packed or alone (the worker's products are
row-invariant, kernels/cpu/row_matmul.py, where OpenBLAS's AVX2 sgemm is not)."""
from __future__ import annotations

import json

import numpy as np
import pytest

from conftest import FIXTURES
from scheduler.diffusion import DiffusionRequest
from shared.diffusion_params import DiffusionParams
from shared.step import SeqChunk, StepRequest
from tensorserve.local import LocalEngine

MODEL = FIXTURES / "diffusion" / "tiny-llada.gguf"
REFERENCE = json.loads((FIXTURES / "diffusion" / "tiny-llada.json").read_text())


@pytest.fixture(scope="module")
def llada() -> LocalEngine:
    return LocalEngine(MODEL)


def _prompts(llada: LocalEngine) -> list[list[int]]:
    texts = ["The capital of France is", "def add(a, b):", "Once upon a time there was a", "Hi"]
    return [llada.tokenizer.encode(t, add_special=True, parse_special=True) for t in texts]


def _cases(llada: LocalEngine) -> list[tuple[list[int], DiffusionParams, int]]:
    """(prompt, params, the batcher step at which it joins)."""
    p = _prompts(llada)

    def gen(prompt: list[int], block: int, blocks: int) -> int:     # a canvas of `blocks` whole blocks
        return blocks * block - len(prompt)
    return [
        (p[0], DiffusionParams(gen(p[0], 8, 3), 6, 8, "confidence"), 0),
        (p[1], DiffusionParams(gen(p[1], 4, 5), 10, 4, "random", temperature=0.8, top_k=20, seed=3), 0),
        (p[2], DiffusionParams(gen(p[2], 8, 4), 8, 8, "low_confidence", threshold=0.2, temperature=0.7, seed=5), 2),
        (p[3], DiffusionParams(gen(p[3], 6, 3), 6, 6, "origin", temperature=1.0, top_p=0.9, seed=9), 3),
        (p[0], DiffusionParams(gen(p[0], 16, 2), 4, 16, "entropy_bound", gamma=3.0, seed=1), 5),
        (p[1], DiffusionParams(gen(p[1], 8, 2), 8, 8, "margin", temperature=0.5, seed=2), 5),
        (p[2], DiffusionParams(gen(p[2], 8, 2), 4, 8, "entropy", top_k=5, temperature=1.0, seed=4), 1),
    ]


def test_a_canvas_gets_bit_identical_logits_packed_or_alone(llada):
    runner = llada.runner
    canvases = [np.array(c["tokens"], np.int64) for c in REFERENCE["forward"][:4]]   # 21, 37, 53, 23 tokens

    def scored(ids: list[int]) -> list[np.ndarray]:
        chunks = [SeqChunk(100 + i, canvases[i], 0, np.zeros(0, np.int32), len(canvases[i]), sample=False,
                           score_top_k=16) for i in ids]
        return [r.score_logprobs for r in runner.execute(StepRequest(chunks)).results]

    alone = [scored([i])[0] for i in range(4)]
    packed = scored([0, 1, 2, 3])
    for a, b in zip(alone, packed):
        assert np.array_equal(a, b)
    assert np.array_equal(scored([3, 1])[1], alone[1])


def test_concurrent_requests_get_their_solo_outputs_in_shared_forwards(llada):
    cases = _cases(llada)
    batcher = llada.diffusion
    solo, solo_steps = [], 0
    for prompt, params, _ in cases:
        request = llada.diffusion_request(prompt, params)
        batcher.add(request)
        while not request.finished:
            batcher.step()
        solo.append(request.output)
        solo_steps += request.steps_taken

    canvases: dict[int, list[list[int]]] = {}
    blocks: dict[int, list[tuple[int, list[int]]]] = {}
    requests = [llada.diffusion_request(prompt, params,
                                        on_step=lambda r: canvases.setdefault(r.seq_id, []).append(list(r.canvas)),
                                        on_block=lambda r, start, tokens: blocks.setdefault(r.seq_id, []).append(
                                            (start, list(tokens))))
                for prompt, params, _ in cases]
    forwards_before = llada.runner.canvas.forwards
    first_step = len(batcher.step_rows)
    step = 0
    while step == 0 or batcher.has_unfinished() or any(not r.finished for r in requests):
        for r, (_, _, join) in zip(requests, cases):
            if join == step:
                batcher.add(r)
        batcher.step()
        step += 1
    rows = batcher.step_rows[first_step:]
    for r, expected in zip(requests, solo):
        assert r.output == expected
        assert r.finish_reason == "length" and len(canvases[r.seq_id]) == r.steps_taken
        assert canvases[r.seq_id][-1] == r.canvas
        # the final blocks, in order, make the whole output
        final = [t for _, tokens in blocks[r.seq_id] for t in tokens]
        assert final == r.output
    # shared forwards: one per batcher step, far fewer than the requests' steps run one by one
    assert llada.runner.canvas.forwards - forwards_before == len(rows)
    assert sum(len(s) for s in rows) == solo_steps
    assert max(len(s) for s in rows) >= 4 and len(rows) < solo_steps
    joined_first = [len(r.canvas) for r, case in zip(requests, cases) if case[2] == 0]
    assert rows[0] == joined_first                       # the first step packs the canvases there at once


def test_the_fixture_runs_batched_reproduce_llama_cpp(llada):
    requests = []
    for run in REFERENCE["cli"]:
        n = len(run["prompt_tokens"])
        params = DiffusionParams(run["n_ubatch"] - n, run["steps"], run["block_length"], run["algorithm"],
                                 top_k=run["top_k"])
        requests.append(llada.diffusion_request(run["prompt_tokens"], params))
    for r in requests:
        llada.diffusion.add(r)
    while any(not r.finished for r in requests):
        llada.diffusion.step()
    for r, run in zip(requests, REFERENCE["cli"]):
        assert llada.tokenizer.decode(r.output) == run["output_text"]


def test_a_finished_request_leaves_the_batch_at_its_last_block(llada):
    prompt = _prompts(llada)[3]
    short = llada.diffusion_request(prompt, DiffusionParams(8 - len(prompt), 2, 8, "confidence"))
    long = llada.diffusion_request(prompt, DiffusionParams(32 - len(prompt), 8, 8, "confidence"))
    assert isinstance(short, DiffusionRequest)
    llada.diffusion.add(short)
    llada.diffusion.add(long)
    first = len(llada.diffusion.step_rows)
    while not long.finished:
        llada.diffusion.step()
    rows = llada.diffusion.step_rows[first:]
    assert [len(r) for r in rows] == [2, 2] + [1] * (len(rows) - 2)
