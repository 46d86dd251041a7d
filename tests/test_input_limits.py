"""Bad input gets a clear 4xx (or gRPC INVALID_ARGUMENT) and loses nothing: each defect found by
hand (a prompt that fills the context with max_tokens past it, lone surrogates, deep nesting,
an unknown role, undecodable gRPC messages), the limits on body size, strings, numbers and
content types, a hypothesis property test over arbitrary JSON bodies and raw gRPC bytes, and
schemathesis against the served /openapi.json. After each, a good request is still served."""
from __future__ import annotations

import json
import sys

import grpc
import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from processes import start_with_ready_file, stop
from protos.tensorserve.v1 import common_pb2, router_pb2, router_pb2_grpc
from router.request_limits import MAX_BODY_BYTES

MODEL = "smollm2-135m"
CONTEXT = 256


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("limits")
    ready = tmp / "serve.json"
    proc, info = start_with_ready_file([sys.executable, "-m", "tensorserve", "serve", "--http-port", "0",
                                        "--grpc-port", "0", "--kv-memory", "64MiB", "--max-context", str(CONTEXT),
                                        "--ready-file", str(ready)], ready, tmp / "serve.log", timeout=300)
    info["base"] = f"http://{info['http']}"
    yield info
    assert stop(proc, timeout=30) == 0


def post(served, path: str, body=None, raw: bytes | None = None, headers: dict | None = None,
         timeout: float = 60) -> httpx.Response:
    content = raw if raw is not None else json.dumps(body).encode()
    return httpx.post(served["base"] + path, content=content, timeout=timeout,
                      headers={"Content-Type": "application/json", **(headers or {})})


def assert_still_serves(served) -> None:
    r = post(served, "/v1/completions", {"model": MODEL, "prompt": "The sky is", "max_tokens": 2})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


def assert_openai_error(r: httpx.Response, status: int, *words: str) -> None:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    for word in words:
        assert word in error["message"], error["message"]


# ----------------------------------------------------------------------------- the defects
def test_a_prompt_that_fills_the_context_with_max_tokens_past_it_is_refused_naming_both(served):
    """It hung (the client gave up after 120 s); vLLM answers 400 naming both numbers."""
    prompt = list(range(100, 100 + CONTEXT - 1))
    r = post(served, "/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 5}, timeout=30)
    assert_openai_error(r, 400, f"holds {CONTEXT} tokens", f"{CONTEXT - 1} in the prompt", "5 for the completion",
                        "at most 1")
    assert r.json()["error"]["code"] == "context_length_exceeded"
    r = post(served, "/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 1}, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 1      # what fits finishes
    chat = post(served, "/v1/chat/completions", {"model": MODEL, "max_tokens": CONTEXT,
                                                 "messages": [{"role": "user", "content": "hi"}]})
    assert_openai_error(chat, 400, "for the completion")
    assert_still_serves(served)


@pytest.mark.parametrize("raw, status, words", [
    (b'{"model": "smollm2-135m", "prompt": "\\ud800", "max_tokens": 2}', 400, ("lone UTF-16 surrogate",)),
    (b'{"model": "smollm2-135m", "messages": [{"role": "user", "content": "\\udfff"}]}', 400, ("surrogate",)),
    (b'{"model": "smollm2-135m", "messages": [{"role": "\\ud800", "content": "hi"}]}', 400, ("surrogate",)),
    (b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", 400, ("nests deeper",)),
    (b'{"prompt": "x", "user": ' + b"[" * 50_000 + b"]" * 50_000 + b"}", 400, ("nests deeper",)),
    (b'{"prompt": "x", "metadata": ' + b'{"a":' * 40 + b"1" + b"}" * 40 + b"}", 400, ("nests deeper",)),
    (b'{"model": "smollm2-135m", "messages": [{"role": "wizard", "content": "hi"}]}', 400, ("role must be one of",)),
    (b'{"prompt": "hi", "temperature": NaN}', 400, ("NaN",)),
    (b'{"prompt": "hi", "temperature": Infinity}', 400, ("Infinity",)),
    (b'{"prompt": "hi", "top_p": 1e400}', 400, ("not a finite number",)),
    (b'{"prompt": "hi", "max_tokens": 1e300}', 400, ("max_tokens",)),
    (b'{"prompt": "hi", "max_tokens": 99999999999999999999999}', 400, ("max_tokens",)),
    (b'{"prompt": "hi", "stop": ["' + b"x" * 5000 + b'"]}', 400, ("stop string",)),
    (b'{"prompt": "hi", "stop": ' + json.dumps(["s"] * 17).encode() + b"}", 400, ("at most 16",)),
    (b'{"prompt": "hi", "n": 3}', 400, ("n=3",)),
    (b'{"prompt": "hi", "logprobs": 1000}', 400, ("logprobs",)),
    (b'{"prompt": "hi"', 400, ("not valid JSON",)),
    (b"[1, 2]", 400, ("JSON object",)),
    (b"\xff\xfe", 400, ("not valid JSON",)),
    (b"", 400, ("not valid JSON",)),
])
def test_malformed_bodies_get_a_4xx_in_openais_shape(served, raw, status, words):
    path = "/v1/chat/completions" if b"messages" in raw else "/v1/completions"
    assert_openai_error(post(served, path, raw=raw), status, *words)
    assert_still_serves(served)


def test_body_size_and_content_type(served):
    big = b'{"prompt": "' + b"a" * (MAX_BODY_BYTES + 1) + b'"}'
    assert_openai_error(post(served, "/v1/completions", raw=big), 413, "at most")
    r = httpx.post(served["base"] + "/v1/completions", content=b'{"prompt": "hi"}',
                   headers={"Content-Type": "text/plain"}, timeout=10)
    assert_openai_error(r, 415, "application/json")
    r = httpx.post(served["base"] + "/v1/completions", data={"prompt": "hi"}, timeout=10)     # a form
    assert_openai_error(r, 415, "application/json")
    assert_still_serves(served)


# ----------------------------------------------------------------------------- gRPC
_PUBLIC = {"/tensorserve.v1.Generation/Generate": True, "/tensorserve.v1.Generation/Tokenize": False,
           "/tensorserve.v1.Generation/Detokenize": False, "/tensorserve.v1.Generation/ListModels": False}


def _raw_call(channel, method: str, payload: bytes):
    kind = channel.unary_stream if _PUBLIC[method] else channel.unary_unary
    call = kind(method, request_serializer=lambda b: b, response_deserializer=lambda b: b)
    result = call(payload, timeout=30)
    return list(result) if _PUBLIC[method] else result


@pytest.mark.parametrize("payload, what", [(b"\xff\xff\xff\xff", "corrupt wire format"),
                                           (b"\x0a\x02\xc3\x28", "invalid UTF-8 in a string field")])
@pytest.mark.parametrize("method", list(_PUBLIC))
def test_undecodable_grpc_messages_are_invalid_argument(served, method, payload, what):
    if method.endswith("ListModels") and payload.startswith(b"\x0a"):
        pytest.skip("ListModelsRequest has no string field 1: the bytes are an unknown field, which is valid")
    with grpc.insecure_channel(served["grpc"]) as channel:
        with pytest.raises(grpc.RpcError) as info:
            _raw_call(channel, method, payload)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, what
    assert "not a valid tensorserve.v1." in info.value.details() and "Traceback" not in info.value.details()


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(method=st.sampled_from(list(_PUBLIC)), payload=st.binary(max_size=64))
def test_no_grpc_bytes_get_unknown_or_internal(served, method, payload):
    with grpc.insecure_channel(served["grpc"]) as channel:
        try:
            _raw_call(channel, method, payload)
        except grpc.RpcError as exc:
            assert exc.code() not in (grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL), (exc.code(), exc.details())


def test_grpc_generate_refuses_max_tokens_past_the_context(served):
    with grpc.insecure_channel(served["grpc"]) as channel:
        stub = router_pb2_grpc.GenerationStub(channel)
        request = router_pb2.GenerateRequest(model=MODEL, token_ids=router_pb2.TokenIds(ids=range(100, 100 + CONTEXT - 1)),
                                             sampling=common_pb2.SamplingParams(max_tokens=5))
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Generate(request, timeout=30))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "5 for the completion" in info.value.details()
        bad_role = router_pb2.GenerateRequest(model=MODEL, chat=router_pb2.ChatMessages(
            messages=[router_pb2.ChatMessage(role="wizard", content="hi")]))
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Generate(bad_role, timeout=30))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "role" in info.value.details()


# ----------------------------------------------------------------------------- properties
_JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
                     lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
                     max_leaves=12)
_FIELDS = st.fixed_dictionaries({}, optional={
    "model": st.sampled_from([MODEL, "other", ""]) | _JSON, "prompt": st.text(max_size=30) | _JSON,
    "messages": st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "x"]) | _JSON,
                                                 "content": st.text(max_size=30) | _JSON}), max_size=3) | _JSON,
    "max_tokens": st.integers(-2, 4) | _JSON, "temperature": st.floats() | _JSON, "stream": st.booleans() | _JSON,
    "stop": st.text(max_size=5) | _JSON, "logprobs": st.integers(-1, 30) | _JSON, "top_p": st.floats() | _JSON,
    "echo": st.booleans() | _JSON, "n": st.integers(0, 2) | _JSON, "seed": st.integers() | _JSON})


@settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(path=st.sampled_from(["/v1/completions", "/v1/chat/completions"]), body=_FIELDS | _JSON)
def test_no_json_body_gets_a_5xx(served, path, body):
    r = post(served, path, raw=json.dumps(body, allow_nan=True).encode(), timeout=60)
    assert r.status_code < 500, (body, r.status_code, r.text[:300])
    if r.status_code >= 400:
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}


def test_still_serving_after_the_properties(served):
    assert_still_serves(served)


def _short(case):
    """Generated requests that would run to the end of the context are cut to a few tokens: the
    test is about what the server accepts, not about generating (CI time)."""
    if isinstance(case.body, dict):
        for name in ("max_tokens", "max_completion_tokens"):
            value = case.body.get(name)
            if isinstance(value, int) and not isinstance(value, bool) and 4 < value <= CONTEXT:
                case.body[name] = 4
        if case.body.get("max_tokens") is None and "messages" in case.body:
            case.body["max_tokens"] = 4
    return case


def test_schemathesis_finds_no_server_error(served):
    """Every operation of the served /openapi.json, with schemathesis's generated bodies (valid
    and invalid), never answers 5xx."""
    from schemathesis.checks import not_a_server_error
    api = schemathesis.openapi.from_url(served["base"] + "/openapi.json")
    operations = [result.ok() for result in api.get_all_operations()]
    assert {op.path for op in operations} >= {"/v1/completions", "/v1/chat/completions", "/v1/models", "/health"}
    calls = []

    for operation in operations:
        @settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck), database=None,
                  derandomize=True)
        @given(case=operation.as_strategy().map(_short))
        def check(case):
            calls.append(case.call_and_validate(checks=[not_a_server_error], timeout=60).status_code)
        check()
    print(f"\nschemathesis: {len(calls)} calls over {len(operations)} operations, statuses {sorted(set(calls))}")
    assert len(calls) >= 4 * len(operations)
    assert_still_serves(served)
