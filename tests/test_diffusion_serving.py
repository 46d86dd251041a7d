"""A text-diffusion model served beside an autoregressive one (`tensorserve serve --model
smollm2-135m --model llada=tests/fixtures/diffusion/tiny-llada.gguf`): chat and completions reach
the diffusion path, reproduce llama-diffusion-cli's runs of the fixture token for token, stream a
`canvas` SSE event per denoising step (plain OpenAI clients read on) and the final text block by
block, gRPC Generate carries CanvasReplace events, concurrent requests each get their alone output,
bad settings get a 400 naming the field, and a client that leaves ends its request."""
from __future__ import annotations

import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import httpx
import openai
import pytest

from processes import start_with_ready_file, stop
from protos.tensorserve.v1 import common_pb2, router_pb2, router_pb2_grpc

FIXTURE = Path(__file__).parent / "fixtures" / "diffusion"
REFERENCE = json.loads((FIXTURE / "tiny-llada.json").read_text())
MASK = REFERENCE["mask_token_id"]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("diffusion-serving")
    ready = tmp / "serve.json"
    cmd = [sys.executable, "-m", "tensorserve", "serve", "--model", "smollm2-135m",
           "--model", f"llada={FIXTURE / 'tiny-llada.gguf'}", "--kv-memory", "32MiB", "--speculative", "off",
           "--grace-period", "5", "--http-port", "0", "--grpc-port", "0", "--ready-file", str(ready)]
    proc, info = start_with_ready_file(cmd, ready, tmp / "serve.log", timeout=300, name="serve")
    info["base"] = f"http://{info['http']}"
    info["client"] = openai.OpenAI(base_url=info["base"] + "/v1", api_key="none", max_retries=0, timeout=120)
    yield info
    assert stop(proc, timeout=60) == 0


def _run_settings(run: dict) -> dict:
    """A fixture run of llama-diffusion-cli as request fields (its -ub is prompt + canvas)."""
    return {"max_tokens": run["n_ubatch"] - len(run["prompt_tokens"]), "temperature": 0,
            "extra_body": {"top_k": run["top_k"], "ignore_eos": True, "diffusion": {"steps": run["steps"],
                                                            "block_length": run["block_length"],
                                                            "algorithm": run["algorithm"]}}}


def _steps_taken(run: dict) -> int:
    """Steps of llama.cpp's schedule: each block takes its steps, or one per masked position when
    it has fewer; an empty block none."""
    n_prompt, total, block = len(run["prompt_tokens"]), run["n_ubatch"], run["block_length"]
    per_block = run["steps"] // (total // block)
    sizes = [max(0, min(n_prompt + (b + 1) * block, total) - (n_prompt + b * block)) for b in range(total // block)]
    return sum(min(per_block, n) for n in sizes)


def _sse_events(base: str, path: str, body: dict) -> list[tuple[str | None, dict]]:
    """(event name, data) of every SSE event of a streamed request, [DONE] left out."""
    out, name = [], None
    with httpx.stream("POST", base + path, json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line[len("event: "):]
            elif line.startswith("data: ") and line != "data: [DONE]":
                out.append((name, json.loads(line[len("data: "):])))
                name = None
    return out


def test_models_lists_both_kinds(served):
    listed = {m["id"]: m for m in httpx.get(served["base"] + "/v1/models", timeout=10).json()["data"]}
    assert listed["smollm2-135m"]["kind"] == "autoregressive"
    assert listed["llada"]["kind"] == "diffusion" and listed["llada"]["architecture"] == "llada"
    assert listed["llada"]["max_model_len"] == 256      # the model's context, not a KV budget


@pytest.mark.parametrize("run", REFERENCE["cli"][:3], ids=lambda r: f"block{r['block_length']}")
def test_chat_reproduces_llama_diffusion_cli(served, run):
    """The router renders the template-less model's chat with ChatML, as llama-diffusion-cli
    --chat does; the text is the fixture run's, non-streamed and streamed alike."""
    client = served["client"]
    messages = [{"role": "user", "content": run["prompt_text"]}]
    reply = client.chat.completions.create(model="llada", messages=messages, **_run_settings(run))
    assert reply.choices[0].message.content == run["output_text"]
    assert reply.usage.prompt_tokens == len(run["prompt_tokens"])
    assert reply.usage.completion_tokens == _run_settings(run)["max_tokens"]
    assert reply.choices[0].finish_reason == "length"
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model="llada", messages=messages, stream=True, **_run_settings(run)) if c.choices)
    assert streamed == run["output_text"]


def test_streamed_completion_sends_a_canvas_per_step_then_blocks(served):
    run = REFERENCE["cli"][2]                   # blocks of 4, 12 steps: several blocks of several steps
    s = _run_settings(run)
    body = {"model": "llada", "prompt": run["prompt_tokens"], "stream": True, "max_tokens": s["max_tokens"],
            "temperature": 0, **s["extra_body"]}
    events = _sse_events(served["base"], "/v1/completions", body)
    canvases = [d for name, d in events if name == "canvas"]
    texts = [d["choices"][0]["text"] for name, d in events if name is None and d["choices"]]
    # one canvas per denoising step: each commits one more position, masks only shrink
    masked = [d["canvas"]["token_ids"].count(MASK) for d in canvases]
    assert [d["canvas"]["step"] for d in canvases] == list(range(1, len(canvases) + 1))
    assert masked == sorted(masked, reverse=True) and masked[-1] == 0 and len(set(masked)) == len(masked)
    assert all(d["choices"][0]["text"] == "" and d["object"] == "text_completion" for d in canvases)
    assert "".join(texts) == run["output_text"]
    # text arrives block by block, between the canvases, not only at the end
    first_text = next(i for i, (name, d) in enumerate(events) if name is None and d["choices"]
                      and d["choices"][0]["text"])
    assert first_text < len(events) - 3
    # an OpenAI client reads the same stream without tripping over the canvas events
    client = served["client"]
    chunks = list(client.completions.create(model="llada", prompt=run["prompt_tokens"], stream=True,
                                            **s))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == run["output_text"]


def test_grpc_generate_carries_canvas_replace_events(served):
    run = REFERENCE["cli"][0]
    stub = router_pb2_grpc.GenerationStub(grpc.insecure_channel(served["grpc"]))
    req = router_pb2.GenerateRequest(model="llada", token_ids=router_pb2.TokenIds(ids=run["prompt_tokens"]),
                                     sampling=common_pb2.SamplingParams(
                                         max_tokens=run["n_ubatch"] - len(run["prompt_tokens"]), temperature=0,
                                         top_k=1, ignore_eos=True),
                                     diffusion=common_pb2.DiffusionOptions(steps=run["steps"],
                                                                           block_length=run["block_length"]))
    events = list(stub.Generate(req, timeout=120))
    kinds = [e.WhichOneof("event") for e in events]
    assert kinds.count("replace") == _steps_taken(run)     # one per step of every block
    replaces = [e.replace for e in events if e.HasField("replace")]
    assert "<|mdm_mask|>" in replaces[0].text and MASK not in replaces[-1].token_ids
    assert "".join(e.delta.text for e in events if e.HasField("delta")) == run["output_text"]
    assert kinds[-1] == "finish" and events[-1].finish.finish_reason == common_pb2.FINISH_REASON_LENGTH


def test_concurrent_sampled_requests_each_get_their_alone_output(served):
    """Sampled (temperature 1, a seed each) requests batched in the scheduler's forwards give what
    each gives alone."""
    client = served["client"]

    def one(seed: int) -> str:
        return client.completions.create(
            model="llada", prompt="Once upon a time", max_tokens=28, temperature=1.0, seed=seed,
            extra_body={"ignore_eos": True, "diffusion": {"block_length": 8, "steps": 16}}).choices[0].text
    alone = [one(seed) for seed in (1, 2, 3)]
    with ThreadPoolExecutor(3) as pool:
        together = list(pool.map(one, (1, 2, 3)))
    assert together == alone and len(set(alone)) == 3


def test_a_stop_token_ends_the_request_before_it(served):
    run = REFERENCE["cli"][1]
    s = _run_settings(run)
    stub = router_pb2_grpc.GenerationStub(grpc.insecure_channel(served["grpc"]))
    sampling = common_pb2.SamplingParams(max_tokens=s["max_tokens"], temperature=0, top_k=1, ignore_eos=True)
    options = common_pb2.DiffusionOptions(steps=run["steps"], block_length=run["block_length"])
    out = [t for e in stub.Generate(router_pb2.GenerateRequest(
        model="llada", token_ids=router_pb2.TokenIds(ids=run["prompt_tokens"]), sampling=sampling,
        diffusion=options), timeout=120) if e.HasField("delta") for t in e.delta.token_ids]
    cut = 20                                   # in the second block: the first block is sent, then it stops
    sampling.stop_token_ids.append(out[cut])
    events = list(stub.Generate(router_pb2.GenerateRequest(
        model="llada", token_ids=router_pb2.TokenIds(ids=run["prompt_tokens"]), sampling=sampling,
        diffusion=options), timeout=120))
    stopped = [t for e in events if e.HasField("delta") for t in e.delta.token_ids]
    assert stopped == out[:out.index(out[cut])]
    assert events[-1].finish.finish_reason == common_pb2.FINISH_REASON_STOP
    assert events[-1].finish.usage.completion_tokens == len(stopped)
    # the later blocks did not run: fewer canvases than the full request's steps
    assert sum(e.HasField("replace") for e in events) < _steps_taken(run)


@pytest.mark.parametrize("body,param,words", [
    ({"diffusion": {"algorithm": "best"}}, None, "diffusion.algorithm"),
    ({"diffusion": {"steps": 7, "block_length": 8}}, None, "diffusion.steps"),
    ({"diffusion": {"speed": 3}}, "diffusion.speed", "not a diffusion option"),
    ({"diffusion": {"steps": "many"}}, "diffusion.steps", "must be an integer"),
    ({"logprobs": 2}, "logprobs", "no logprobs"),
    ({"max_tokens": 240, "diffusion": {"block_length": 100}}, None, "exceed the context of 256"),
    ({"frequency_penalty": 0.5}, None, "frequency_penalty is not supported"),
])
def test_bad_diffusion_settings_get_a_400_naming_them(served, body, param, words):
    r = httpx.post(served["base"] + "/v1/completions",
                   json={"model": "llada", "prompt": "Once upon a time", "max_tokens": 12, **body}, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert words in err["message"], err
    if param:
        assert err["param"] == param


def test_the_autoregressive_model_beside_it_is_unaffected(served):
    client = served["client"]
    out = client.chat.completions.create(model="smollm2-135m", messages=[{"role": "user", "content": "Hi"}],
                                         max_tokens=4, temperature=0)
    assert out.choices[0].message.content and out.usage.completion_tokens <= 4
    r = httpx.post(served["base"] + "/v1/completions", json={"model": "smollm2-135m", "prompt": "Hi",
                                                             "max_tokens": 4, "diffusion": {"steps": 4}}, timeout=60)
    assert r.status_code == 400 and "autoregressive" in r.json()["error"]["message"]


def _metric(base: str, name: str, model: str | None = None) -> float:
    for line in httpx.get(base + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name) and (model is None or f'model="{model}"' in line):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics")


def test_a_client_that_leaves_ends_its_request(served):
    """A streamed request of 240 one-token blocks (240 steps over a 244-token canvas) whose client
    disconnects after the first canvas stops within a few steps: the worker computes far fewer
    tokens than the whole request would have."""
    base = served["base"]
    computed = _metric(base, "tensorserve_tokens_computed_total")
    body = {"model": "llada", "prompt": "Once upon a time", "max_tokens": 240, "stream": True, "temperature": 0,
            "diffusion": {"block_length": 1}}
    with httpx.stream("POST", base + "/v1/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("event: canvas"):
                break
    deadline = time.monotonic() + 20
    while _metric(base, "tensorserve_replica_num_requests_running", "llada") and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _metric(base, "tensorserve_replica_num_requests_running", "llada") == 0
    spent = _metric(base, "tensorserve_tokens_computed_total") - computed
    assert 0 < spent < 244 * 240 / 4, spent
