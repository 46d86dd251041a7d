"""Speculative decoding with a draft GGUF model (`--speculative draft --draft-model`), and the
self-speculative drafts `tensorserve make-draft` writes: greedy output is the plain output token
for token (with a made draft and with the target as its own draft, which accepts every draft),
sampled output keeps the target's distribution, batching / preemption / abort / the prefix cache
keep working, and a draft of another vocabulary is refused at start with both models named."""
from __future__ import annotations

import re
import subprocess
import sys

import numpy as np
import pytest

from conftest import load_fixture
from processes import start_with_ready_file, stop
from scheduler.engine import Engine
from scheduler.sequence import Sequence
from scheduler.speculative import SpeculativeController, make_controller
from shared.gguf_file import GGUFFile
from shared.model_config import ModelConfig
from shared.model_registry import resolve_model
from shared.sampling_params import SamplingParams
from shared.step import SeqChunk
from test_sampling import CHI2_999
from test_speculative_decoding import run_aborting, top4_probs

MODEL = "smollm2-135m"
DRAFT_LAYERS = 8


@pytest.fixture(scope="module")
def made_draft(tmp_path_factory):
    from tensorserve.make_draft import make_draft
    return make_draft(resolve_model(MODEL), DRAFT_LAYERS, tmp_path_factory.mktemp("draft") / "smollm2-draft.gguf")


@pytest.fixture(scope="module")
def self_runner():
    """The target as its own draft (its weights shared, a K/V pool of its own)."""
    from worker.model_runner import ModelRunner
    return ModelRunner(resolve_model(MODEL), kv_memory=48 * 2**20, draft_model=resolve_model(MODEL))


@pytest.fixture(scope="module")
def made_runner(made_draft):
    from worker.model_runner import ModelRunner
    return ModelRunner(resolve_model(MODEL), kv_memory=48 * 2**20, draft_model=made_draft)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return [c["prompt_tokens"] for c in load_fixture(MODEL)["generate"]]


@pytest.fixture(scope="module")
def reference(greedy_references) -> list[list[int]]:
    """Plain greedy outputs of `prompts`, batched, on the session's runner without speculation."""
    return greedy_references(MODEL, 20)


def greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, **kw)


def make_engine(runner, speculative: SpeculativeController | None = None, num_blocks: int | None = None,
                **kw) -> Engine:
    cap = runner.capacity
    return Engine(runner.execute, num_blocks or cap.num_blocks, cap.block_size, cap.max_context,
                  fingerprint=runner.config.fingerprint, speculative=speculative, **kw)


def run(engine: Engine, seqs: list[Sequence]) -> list[list[int]]:
    for s in seqs:
        engine.add(s)
    while engine.has_work():
        engine.step()
    return [s.output for s in seqs]


# ---- make-draft ----------------------------------------------------------------------------------

def test_make_draft_writes_a_gguf_of_the_first_layers_head_and_vocabulary(made_draft):
    target, draft = GGUFFile(resolve_model(MODEL)), GGUFFile(made_draft)
    config = ModelConfig.from_gguf(draft)
    assert config.n_layers == DRAFT_LAYERS and draft.metadata["llama.block_count"] == DRAFT_LAYERS
    assert ModelConfig.from_gguf(target).n_layers > DRAFT_LAYERS
    layers = {int(m.group(1)) for n in draft.tensors if (m := re.match(r"blk\.(\d+)\.", n))}
    assert layers == set(range(DRAFT_LAYERS))
    expected = {n for n in target.tensors if not n.startswith("blk.")
                or int(n.split(".")[1]) < DRAFT_LAYERS}
    assert set(draft.tensors) == expected and {"token_embd.weight", "output_norm.weight"} <= expected
    for name in draft.tensors:                  # the target's bytes, in their own types
        assert draft.tensors[name].ggml_type == target.tensors[name].ggml_type
        assert np.array_equal(draft.raw(name), target.raw(name)), name
    assert draft.metadata["tokenizer.ggml.tokens"] == target.metadata["tokenizer.ggml.tokens"]
    assert draft.metadata["tokenizer.ggml.merges"] == target.metadata["tokenizer.ggml.merges"]
    assert config.vocab_size == ModelConfig.from_gguf(target).vocab_size


def test_make_draft_refuses_more_layers_than_the_model_has(tmp_path):
    from tensorserve.make_draft import make_draft
    with pytest.raises(ValueError, match=r"--layers 99: .* has 30 layers"):
        make_draft(resolve_model(MODEL), 99, tmp_path / "x.gguf")


# ---- in process ----------------------------------------------------------------------------------

def test_greedy_output_with_the_target_as_its_own_draft_is_plain_and_accepts_every_draft(self_runner, prompts,
                                                                                          reference):
    spec = make_controller("draft", 3, governor=False)
    assert run(make_engine(self_runner, spec), [Sequence(list(p), greedy(20)) for p in prompts]) == reference
    assert spec.stats.drafts > 0
    assert spec.stats.accepted_tokens == spec.stats.draft_tokens, spec.stats     # acceptance 100 %


def test_greedy_output_with_a_made_draft_is_plain(made_runner, prompts, reference):
    spec = make_controller("draft", 2, governor=False)
    assert run(make_engine(made_runner, spec), [Sequence(list(p), greedy(20)) for p in prompts]) == reference
    assert spec.stats.drafts > 0 and spec.stats.draft_tokens > 0


def test_batched_drafts_with_plain_decodes_prefill_preemption_abort_and_prefix_cache(self_runner, prompts,
                                                                                    reference):
    """Sequences with and without drafts and prompt chunks share steps in a pool small enough to
    preempt; one is aborted mid-way; every output is its plain one, every draft is accepted (the
    draft's K/V followed each sequence through preemption and its recompute), every block comes
    back, and a second turn reusing the cached blocks still matches."""
    chosen = [i for i, p in enumerate(prompts) if len(p) < 200]
    lengths = [20, 10, 16, 6, 20, 14, 18, 12][:len(chosen)]
    spec = make_controller("draft", 3, governor=False)
    engine = make_engine(self_runner, spec, num_blocks=12, max_num_batched_tokens=48)
    seqs = [Sequence(list(prompts[i]), greedy(n)) for i, n in zip(chosen, lengths)]
    seqs[1].speculative = False
    doomed = Sequence(list(prompts[chosen[0]]), greedy(20))
    run_aborting(engine, seqs, doomed, at_step=4)
    for s, i, n in zip(seqs, chosen, lengths):
        assert s.output == reference[i][:n], i
    assert doomed.finish_reason == "abort"
    assert engine.num_preemptions > 0
    assert spec.stats.drafts > 0 and spec.stats.accepted_tokens == spec.stats.draft_tokens, spec.stats
    assert engine.blocks.num_free == engine.blocks.num_blocks
    # prefix cache: a prompt run twice (in a fresh engine) starts the second time from its cached
    # blocks, the target's and the draft's (whose blocks carry the key of the prefix their K/V is
    # of), with the same output
    spec = make_controller("draft", 3, governor=False)
    engine = make_engine(self_runner, spec)
    longest = max(chosen, key=lambda i: len(prompts[i]))
    drafter = self_runner.drafter
    computed = []
    for _ in range(2):
        before = drafter.draft_tokens_computed
        assert run(engine, [Sequence(list(prompts[longest]), greedy(16))]) == [reference[longest][:16]]
        computed.append(drafter.draft_tokens_computed - before)
    full = (len(prompts[longest]) - 1) // 16 * 16
    assert engine.blocks.hit_tokens >= full > 0
    assert computed[1] <= computed[0] - full, computed
    assert spec.stats.accepted_tokens == spec.stats.draft_tokens, spec.stats


def test_sampled_tokens_with_greedy_drafts_keep_the_target_distribution(made_runner):
    """The draft model drafts its argmax (deterministic given the context), verified as a one-hot
    proposal: the second token of many seeded samples at temperature 1 (top-k 4) follows the
    target's own distribution (chi-square against the probabilities read from its logits)."""
    runner = made_runner
    prompt = load_fixture(MODEL)["generate"][0]["prompt_tokens"]
    first = top4_probs(runner, prompt)
    likely = max(first, key=first.get)
    after = top4_probs(runner, prompt + [likely])
    spec = make_controller("draft", 1, governor=False)
    engine = make_engine(runner, spec, enable_prefix_caching=False)
    seqs = [Sequence(list(prompt), SamplingParams(max_tokens=3, temperature=1.0, top_k=4, seed=s))
            for s in range(200)]
    run(engine, seqs)
    assert spec.stats.drafts >= len(seqs)
    seconds = [s.output[1] for s in seqs if s.output[0] == likely]
    assert len(seconds) > 50
    ids = sorted(after)
    counts = np.array([seconds.count(t) for t in ids], np.float64)
    assert counts.sum() == len(seconds)
    expected = np.array([after[t] for t in ids]) * len(seconds)
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < CHI2_999[len(ids) - 1], (chi2, counts, expected)


def test_gemma3_with_a_made_draft_keeps_its_greedy_output(greedy_references, tmp_path):
    """The other architecture (sliding-window layers, tied head): a draft of Gemma 3's first 6
    layers drafts, and the greedy output is the plain one."""
    from tensorserve.make_draft import make_draft
    from worker.model_runner import ModelRunner
    draft = make_draft(resolve_model("gemma3-270m"), 6, tmp_path / "gemma3-draft.gguf")
    config = ModelConfig.from_gguf(GGUFFile(draft))
    target = ModelConfig.from_gguf(GGUFFile(resolve_model("gemma3-270m")))
    assert config.n_layers == 6 and [config.layer_window(i) for i in range(6)] == \
        [target.layer_window(i) for i in range(6)]
    runner = ModelRunner(resolve_model("gemma3-270m"), kv_memory=32 * 2**20, draft_model=draft)
    prompts = [c["prompt_tokens"] for c in load_fixture("gemma3-270m")["generate"]]
    spec = make_controller("draft", 2, governor=False)
    assert run(make_engine(runner, spec), [Sequence(list(p), greedy(12)) for p in prompts]) == \
        greedy_references("gemma3-270m", 12)
    assert spec.stats.draft_tokens > 0


def test_the_worker_refuses_placeholders_without_a_draft_model_or_misplaced(engines, self_runner):
    from shared.step import StepRequest
    from worker.server import BadStep, WorkerServicer

    def step(tokens: list[int], num_draft: int) -> StepRequest:
        return StepRequest([SeqChunk(seq_id=1, token_ids=np.asarray(tokens, np.int64), start_pos=4,
                                     block_table=np.arange(1, dtype=np.int32), prompt_len=4,
                                     params=greedy(8), num_draft=num_draft)])
    plain_worker = WorkerServicer(engines(MODEL).runner, MODEL, "cpu")
    draft_worker = WorkerServicer(self_runner, MODEL, "cpu")
    try:
        assert plain_worker.Describe(None, None).draft_model == ""
        assert draft_worker.Describe(None, None).draft_model == resolve_model(MODEL).name
        with pytest.raises(BadStep, match="no draft model"):
            plain_worker._validate(step([5, -1, -1], 2))
        draft_worker._validate(step([5, -1, -1], 2))
        with pytest.raises(BadStep, match="placeholders"):
            draft_worker._validate(step([5, 7, -1], 2))
        with pytest.raises(BadStep, match="token ids must lie"):
            draft_worker._validate(step([-1, -1, -1], 2))
    finally:
        plain_worker.close()
        draft_worker.close()


def test_a_draft_of_another_vocabulary_is_refused_naming_both_models():
    from worker.draft_model import VocabularyMismatch
    from worker.model_runner import ModelRunner
    with pytest.raises(VocabularyMismatch, match=r"(?i)draft model .*gemma.* does not share the vocabulary of the "
                                                 r"target .*SmolLM2.*: vocabulary size 262144 against the "
                                                 r"target's 49152"):
        ModelRunner(resolve_model(MODEL), kv_memory=16 * 2**20, draft_model=resolve_model("gemma3-270m"))


# ---- CLI and served stack ------------------------------------------------------------------------

def tensorserve(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tensorserve", *args], capture_output=True, text=True, timeout=600)


def test_cli_make_draft_then_generate_with_it_and_with_the_target_as_draft(tmp_path, made_draft):
    out_file = tmp_path / "d.gguf"
    made = tensorserve("make-draft", "--model", MODEL, "--layers", "4", "--out", str(out_file))
    assert made.returncode == 0, made.stderr
    assert ModelConfig.from_gguf(GGUFFile(out_file)).n_layers == 4
    alone = tensorserve("generate", "--model", str(out_file), "--prompt", "Hello", "--max-tokens", "4",
                        "--kv-memory", "32MiB")
    assert alone.returncode == 0 and alone.stdout.strip(), alone.stderr      # loads as an ordinary model
    case = load_fixture(MODEL)["generate"][0]
    base = ["generate", "--model", MODEL, "--prompt", case["prompt_text"], "--max-tokens", "16",
            "--kv-memory", "64MiB"]
    expected = tensorserve(*base)                # the plain output (test_cli compares it with llama.cpp's)
    assert expected.returncode == 0 and expected.stdout.strip(), expected.stderr
    for draft in (str(made_draft), MODEL):
        got = tensorserve(*base, "--speculative", "draft", "--draft-model", draft)
        assert got.returncode == 0, got.stderr
        assert got.stdout == expected.stdout, draft


def metric(text: str, name: str) -> float:
    found = re.search(rf"^{name} ([0-9.e+-]+)$", text, re.M)
    assert found, f"{name} not in /metrics"
    return float(found.group(1))


@pytest.mark.parametrize("draft", ["self", "made"])
def test_served_greedy_output_equals_plain_with_a_draft_model(tmp_path, greedy_references, made_draft, draft):
    import httpx
    draft_arg = MODEL if draft == "self" else str(made_draft)
    ready = tmp_path / "serve.json"
    proc, info = start_with_ready_file(
        [sys.executable, "-m", "tensorserve", "serve", "--http-port", "0", "--grpc-port", "0", "--kv-memory",
         "64MiB", "--grace-period", "5", "--ready-file", str(ready), "--speculative", "draft",
         "--draft-model", draft_arg, "--num-speculative-tokens", "3"], ready, tmp_path / "serve.log",
        timeout=300, name="serve")
    try:
        prompts = [c["prompt_tokens"] for c in load_fixture(MODEL)["generate"]][:3]
        expected = greedy_references(MODEL, 16)[:3]
        base = f"http://{info['http']}"
        from router.tokenizer import Tokenizer
        tokenizer = Tokenizer.from_metadata(GGUFFile(resolve_model(MODEL)).metadata)
        with httpx.Client(timeout=180) as client:
            for ids, want in zip(prompts, expected):
                r = client.post(f"{base}/v1/completions", json={"model": MODEL, "prompt": ids, "max_tokens": 16,
                                                                 "temperature": 0, "ignore_eos": True})
                assert r.status_code == 200, r.text
                assert r.json()["choices"][0]["text"] == tokenizer.decode(want)
            metrics = client.get(f"{base}/metrics").text
            drafted = metric(metrics, "tensorserve_spec_decode_num_draft_tokens_total")
            accepted = metric(metrics, "tensorserve_spec_decode_num_accepted_tokens_total")
            assert drafted > 0 and metric(metrics, "tensorserve_spec_decode_num_drafts_total") > 0
            if draft == "self":
                assert accepted == drafted                 # acceptance 100 %
    finally:
        stop(proc, timeout=60)


def test_serve_refuses_a_draft_of_another_vocabulary_at_start(tmp_path):
    out = subprocess.run([sys.executable, "-m", "tensorserve", "serve", "--http-port", "0", "--grpc-port", "0",
                          "--speculative", "draft", "--draft-model", "gemma3-270m"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 2, out.stderr
    assert "--draft-model gemma3-270m" in out.stderr and "does not share the vocabulary" in out.stderr
    assert "smollm2-135m" in out.stderr and "vocabulary size 262144 against the target's 49152" in out.stderr


def test_a_scheduler_speculating_with_a_draft_model_waits_for_a_worker_that_runs_one(tmp_path):
    """`tensorserve scheduler --speculative draft` against a worker started without --draft-model:
    not serving, and its status says why."""
    import grpc

    from processes import wait_for
    from protos.tensorserve.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc
    procs = []
    try:
        worker, winfo = start_with_ready_file(
            [sys.executable, "-m", "worker.main", "--model", MODEL, "--kv-memory", "16MiB", "--ready-file",
             str(tmp_path / "w.json")], tmp_path / "w.json", tmp_path / "worker.log", timeout=300)
        procs.append(worker)
        sched, sinfo = start_with_ready_file(
            [sys.executable, "-m", "scheduler.main", "--port", "0", "--ready-file", str(tmp_path / "s.json"),
             "--worker", winfo["address"], "--speculative", "draft"], tmp_path / "s.json",
            tmp_path / "scheduler.log", timeout=120)
        procs.append(sched)
        with grpc.insecure_channel(sinfo["address"]) as channel:
            stub = scheduler_pb2_grpc.SchedulerStub(channel)
            assert wait_for(lambda: "runs no draft model" in stub.Stats(scheduler_pb2.StatsRequest()).status_message,
                            30), stub.Stats(scheduler_pb2.StatsRequest())
            assert stub.Stats(scheduler_pb2.StatsRequest()).status == common_pb2.SERVING_STATUS_NOT_SERVING
    finally:
        for p in reversed(procs):
            stop(p)
