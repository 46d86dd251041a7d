"""Sliding-window layers keep only their window (worker/kv_pool.py, scheduler/window_blocks.py): Gemma 3's
five windowed layers to one global get a pool of their own sized for --max-num-seqs windows, the
blocks that leave a sequence's window are released, and nothing a client sees changes: greedy tokens
equal those of one pool keeping every position (--swa-full), through prefix hits (whole blocks and a
block's first tokens), preemption when the windowed pool runs short, and checkpoints restored after a
restart of `serve`."""
from __future__ import annotations

import sys

import httpx
import numpy as np
import pytest

from processes import start_with_ready_file, stop
from shared.gguf_file import GGUFFile
from shared.model_config import ModelConfig
from shared.model_registry import resolve_model
from shared.sampling_params import SamplingParams
from worker.kv_pool import bytes_per_block, plan_capacity, windowed_layers

MODEL = "gemma3-270m"
GREEDY = SamplingParams(max_tokens=12, temperature=0.0)


@pytest.fixture(scope="module")
def gemma_config() -> ModelConfig:
    return ModelConfig.from_gguf(GGUFFile(resolve_model(MODEL)))


def prompts(seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    long = rng.integers(100, 20000, size=1300).tolist()
    return [rng.integers(100, 20000, size=700).tolist(), long, rng.integers(100, 20000, size=40).tolist(),
            long[:900] + rng.integers(100, 20000, size=60).tolist(),          # a cached prefix, a new suffix
            long[:1000] + [7],                                                # inside a cached block
            rng.integers(100, 20000, size=2100).tolist()]


def run(swa_full: bool, kv_memory: int, max_num_seqs: int = 4) -> tuple[list[list[int]], object]:
    from tensorserve.local import LocalEngine
    engine = LocalEngine(MODEL, load_tokenizer=False, kv_memory=kv_memory, max_num_seqs=max_num_seqs,
                         swa_full=swa_full)
    first = engine.generate(prompts()[:3], GREEDY)
    later = engine.generate(prompts()[3:], GREEDY)        # prefix hits on the long prompt's blocks
    return [c.tokens for c in first + later], engine


def test_the_windowed_layers_pool_is_sized_for_max_num_seqs_windows_and_the_full_layers_get_the_rest(gemma_config):
    c = gemma_config
    windowed = windowed_layers(c)
    assert len(windowed) == 15 and c.n_layers == 18            # Gemma 3 270M: five windowed layers to one
    budget = 512 * 2**20
    one_pool = plan_capacity(c, budget, 16, None, "f16", None)
    assert one_pool.num_window_blocks == 0
    split = plan_capacity(c, budget, 16, None, "f16", max_num_seqs=8, max_num_batched_tokens=256)
    assert split.window == 512 and 0 < split.num_window_blocks < one_pool.num_blocks
    used = (split.num_blocks * bytes_per_block(c, 16, "f16", c.n_layers - len(windowed))
            + split.num_window_blocks * bytes_per_block(c, 16, "f16", len(windowed)))
    assert budget - bytes_per_block(c, 16, "f16", 3) < used <= budget
    # the whole trained context fits where one pool held 29k tokens
    assert split.max_context == c.context_length > one_pool.max_context
    # a budget the windows of --max-num-seqs would not leave room in keeps one pool
    assert plan_capacity(c, budget, 16, None, "f16", max_num_seqs=64).num_window_blocks == 0
    smollm = ModelConfig.from_gguf(GGUFFile(resolve_model("smollm2-135m")))
    assert plan_capacity(smollm, budget, 16, None, "f16", max_num_seqs=1).num_window_blocks == 0


def test_greedy_tokens_equal_one_pools_through_prefix_hits_and_released_windows():
    plain, full_engine = run(swa_full=True, kv_memory=96 * 2**20)
    windowed, engine = run(swa_full=False, kv_memory=96 * 2**20)
    cap = engine.runner.capacity
    assert cap.num_window_blocks > 0 and cap.num_blocks > full_engine.runner.capacity.num_blocks
    assert windowed == plain
    assert engine.engine.blocks.hit_tokens == full_engine.engine.blocks.hit_tokens > 900
    # every sequence gave its blocks back to both pools (cached ones stay reclaimable)
    assert engine.engine.window.num_free == cap.num_window_blocks
    assert engine.engine.blocks.num_free == cap.num_blocks


def test_a_long_prompt_holds_only_its_window_in_the_windowed_pool():
    from scheduler.sequence import Sequence
    from tensorserve.local import LocalEngine
    engine = LocalEngine(MODEL, load_tokenizer=False, kv_memory=96 * 2**20, max_num_seqs=2)
    e = engine.engine
    seq = Sequence(prompts()[5], SamplingParams(max_tokens=40, temperature=0.0))
    e.add(seq)
    most = 0
    released = 0
    while e.has_work():
        planned_from = seq.num_computed
        e.step()
        live = [b for b in seq.window_table if b >= 0]
        most = max(most, len(live))
        if seq.status.value == "running":
            # the step was planned after releasing the blocks before the window of its first position
            first = e.window.first_needed(planned_from)
            assert seq.window_table[:first] == [-1] * first and all(b >= 0 for b in seq.window_table[first:])
            released = max(released, first)
    assert released >= (2100 - 512) // 16
    window_blocks = 512 // 16
    assert most <= window_blocks + 1 + 256 // 16 + 1       # a window and a prefill chunk at most
    assert len(seq.output) == 40


def test_a_windowed_pool_too_small_for_every_sequence_holds_admissions_back_and_keeps_the_tokens():
    plain, _ = run(swa_full=True, kv_memory=96 * 2**20, max_num_seqs=4)
    # sized for 2 sequences' windows while 4 may run: the windowed pool is what runs out
    from tensorserve.local import LocalEngine
    engine = LocalEngine(MODEL, load_tokenizer=False, kv_memory=96 * 2**20, max_num_seqs=2)
    engine.engine.max_num_seqs = 4
    e = engine.engine
    short = []
    original = e._schedule

    def schedule():
        plan = original()
        short.append(e.window.num_free < e.blocks.num_free and bool(e.waiting))
        return plan
    e._schedule = schedule
    first = engine.generate(prompts()[:3], GREEDY)
    later = engine.generate(prompts()[3:], GREEDY)
    assert [c.tokens for c in first + later] == plain
    assert any(short)          # prompts waited on the windowed pool while the main one had room


# ----------------------------------------------------------------------------- through serve
LONG = " ".join(f"Item {i}: the {['red', 'blue', 'green', 'amber'][i % 4]} box holds {i * 7 % 113} "
                f"stones and {i * 13 % 97} shells." for i in range(90))


def start_stack(tmp, name: str, *extra: str):
    ready = tmp / f"{name}.json"
    cmd = [sys.executable, "-m", "tensorserve", "serve", "--model", MODEL, "--http-port", "0", "--grpc-port", "0",
           "--kv-memory", "96MiB", "--grace-period", "5", "--ready-file", str(ready),
           "--checkpoint-dir", str(tmp / "checkpoints"), *extra]
    return start_with_ready_file(cmd, ready, tmp / f"{name}.log", timeout=240, name=name,
                                 env={"TS_PREFIX_CHECKPOINTS": "1"})


def complete(info: dict, prompt: str) -> dict:
    r = httpx.post(f"http://{info['http']}/v1/completions", timeout=300, json={
        "model": MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 0, "logprobs": 1})
    assert r.status_code == 200, r.text
    body = r.json()
    return {"tokens": body["choices"][0]["logprobs"]["tokens"],
            "cached": body["usage"]["prompt_tokens_details"]["cached_tokens"],
            "prompt_tokens": body["usage"]["prompt_tokens"]}


def test_serve_restores_a_checkpointed_prefix_into_both_pools_after_a_restart(tmp_path):
    from processes import wait_for
    question = [" What does item 3 hold?", " Which boxes are red?"]
    proc, info = start_stack(tmp_path, "full", "--swa-full", "--no-prefix-checkpoints")
    try:
        expected = [complete(info, LONG + q)["tokens"] for q in question]
    finally:
        assert stop(proc, timeout=60) == 0
    proc, info = start_stack(tmp_path, "windowed", "--max-num-seqs", "4", "--no-prefix-checkpoints")
    try:
        cold = complete(info, LONG + question[0])
        assert cold["prompt_tokens"] > 1500 and cold["tokens"] == expected[0]
        warm = complete(info, LONG + question[1])               # a prefix hit in the pool
        assert warm["cached"] > 1400 and warm["tokens"] == expected[1]
        metrics = httpx.get(f"http://{info['http']}/metrics", timeout=10).text
        total = [float(line.split()[-1]) for line in metrics.splitlines()
                 if line.startswith("tensorserve_kv_window_blocks_total ")]
        assert total and total[0] > 0                          # /metrics shows the windowed pool
    finally:
        assert stop(proc, timeout=60) == 0
    # checkpoints written by a windowed stack, restored by a new one
    proc, info = start_stack(tmp_path, "saving", "--max-num-seqs", "4")
    try:
        assert complete(info, LONG + question[0])["tokens"] == expected[0]
        metrics = lambda: httpx.get(f"http://{info['http']}/metrics", timeout=10).text   # noqa: E731
        assert wait_for(lambda: "tensorserve_checkpoint_store_puts_total" in metrics() and any(
            line.startswith("tensorserve_checkpoint_store_puts_total") and float(line.split()[-1]) >= 90
            for line in metrics().splitlines()), 60, interval=0.5)
    finally:
        assert stop(proc, timeout=60) == 0
    proc, info = start_stack(tmp_path, "restoring", "--max-num-seqs", "4")
    try:
        restored = complete(info, LONG + question[1])
        assert restored["cached"] > 1400 and restored["tokens"] == expected[1]
    finally:
        assert stop(proc, timeout=60) == 0
