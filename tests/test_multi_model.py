"""Two models behind one router (`tensorserve serve --model smollm2-135m --model gemma3-270m`):
each request reaches its own model's scheduler and worker (and its own chat template: Gemma 3
270M, a base model, has none, SmolLM2 has one), /v1/models and ListModels list both,
a request for another model (or, with several, for none) gets a 404 naming the served ids, and
/health and /metrics cover both groups."""
from __future__ import annotations

import sys

import grpc
import httpx
import openai
import pytest

from conftest import load_fixture
from processes import start_with_ready_file, stop
from protos.tensorserve.v1 import common_pb2, router_pb2, router_pb2_grpc
from shared.sampling_params import SamplingParams

MODELS = ("smollm2-135m", "gemma3-270m")


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("multi-model")
    ready = tmp / "serve.json"
    cmd = [sys.executable, "-m", "tensorserve", "serve", *[a for m in MODELS for a in ("--model", m)],
           "--kv-memory", "32MiB", "--speculative", "off", "--grace-period", "5",
           "--http-port", "0", "--grpc-port", "0", "--ready-file", str(ready)]
    proc, info = start_with_ready_file(cmd, ready, tmp / "serve.log", timeout=300, name="serve")
    info["base"] = f"http://{info['http']}"
    yield info
    assert stop(proc, timeout=60) == 0


def test_both_models_are_listed_with_their_kind(served):
    listed = httpx.get(served["base"] + "/v1/models", timeout=10).json()["data"]
    assert [m["id"] for m in listed] == list(MODELS)
    assert [m["architecture"] for m in listed] == ["llama", "gemma3"]
    assert all(m["kind"] == "autoregressive" and m["max_model_len"] > 0 for m in listed)
    stub = router_pb2_grpc.GenerationStub(grpc.insecure_channel(served["grpc"]))
    models = stub.ListModels(router_pb2.ListModelsRequest(), timeout=10).models
    assert [(m.id, m.kind) for m in models] == [(m, router_pb2.MODEL_KIND_AUTOREGRESSIVE) for m in MODELS]
    assert all(m.max_context > 0 and m.vocab_size > 0 for m in models) and models[0].vocab_size != models[1].vocab_size


@pytest.mark.parametrize("model", MODELS)
def test_each_model_generates_its_own_tokens(served, engines, model):
    """Greedy tokens through the router equal the model's own in-process generation, so the
    request reached that model's worker; chat and completions answer through the openai client."""
    case = load_fixture(model)["generate"][0]
    n = 6
    expected = engines(model).generate([case["prompt_tokens"]], SamplingParams(
        max_tokens=n, temperature=0.0, ignore_eos=True))[0].tokens
    stub = router_pb2_grpc.GenerationStub(grpc.insecure_channel(served["grpc"]))
    got = []
    for event in stub.Generate(router_pb2.GenerateRequest(
            model=model, token_ids=router_pb2.TokenIds(ids=case["prompt_tokens"]),
            sampling=common_pb2.SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)), timeout=120):
        if event.HasField("delta"):
            got.extend(event.delta.token_ids)
    assert got == expected
    client = openai.OpenAI(base_url=served["base"] + "/v1", api_key="unused", max_retries=0)
    chat = dict(model=model, max_tokens=4, temperature=0, messages=[{"role": "user", "content": "Say hello."}])
    if model == "gemma3-270m":          # a base model: its own GGUF has no chat template
        with pytest.raises(openai.BadRequestError, match="Gemma 3 270m' has no chat template"):
            client.chat.completions.create(**chat)
    else:
        answer = client.chat.completions.create(**chat)
        assert answer.model == model and answer.choices[0].message.content and answer.usage.completion_tokens <= 4
    completion = client.completions.create(model=model, prompt="The capital of France is", max_tokens=3,
                                           temperature=0)
    assert completion.model == model and completion.usage.completion_tokens == 3


def test_an_unknown_or_missing_model_is_a_404_naming_the_served_ids(served):
    for body in ({"model": "no-such-model"}, {}):
        r = httpx.post(served["base"] + "/v1/completions", timeout=10, json={**body, "prompt": "Hi", "max_tokens": 1})
        assert r.status_code == 404, r.text
        error = r.json()["error"]
        assert error["code"] == "model_not_found" and error["param"] == "model"
        assert all(f"'{m}'" in error["message"] for m in MODELS)
    stub = router_pb2_grpc.GenerationStub(grpc.insecure_channel(served["grpc"]))
    with pytest.raises(grpc.RpcError) as failure:
        list(stub.Generate(router_pb2.GenerateRequest(model="no-such-model", text="Hi"), timeout=10))
    assert failure.value.code() == grpc.StatusCode.NOT_FOUND and MODELS[1] in failure.value.details()


def test_health_and_metrics_cover_every_model(served):
    health = httpx.get(served["base"] + "/health", timeout=10).json()
    assert health["status"] == "ok"
    for model in MODELS:
        mine = [c for c in health["components"] if c.get("model") == model]
        assert {c["name"].split("-")[0] for c in mine} == {"scheduler", "worker"}, health
        assert all(c["process"] == "running" and c["restarts"] == 0 for c in mine)
    text = httpx.get(served["base"] + "/metrics", timeout=10).text
    for model in MODELS:
        assert f'tensorserve_replica_up{{model="{model}",replica="0"}} 1.0' in text
        assert f'tensorserve_process_up{{process="scheduler/{model}/0"}} 1.0' in text
