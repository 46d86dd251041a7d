"""The router as a real process, driven by real clients (the official `openai` package and grpcio).

Two back ends:
* ``fake``: a small Scheduler servicer in this test process that streams
  deterministic tokens (always available);
* ``real``: `python -m worker.main` and `python -m scheduler.main` processes
  with SmolLM2 (skipped when those entry points are missing or do not start).
"""
from __future__ import annotations

import json
import subprocess
import sys
import time
from concurrent import futures
from pathlib import Path

import grpc
import httpx
import openai
import pytest

from processes import free_port, start_with_ready_file, stop
from shared import grpc_health
from protos.tensorserve.v1 import common_pb2, router_pb2, router_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable
MODEL = "smollm2-135m"
API_KEY = "sk-test-key"
FAKE_CONTEXT = 512
FAKE_REPLY = "Hello there! I am a fake scheduler. STOP here please, and then more text follows."


# ----------------------------------------------------------------------------- fake scheduler
class FakeScheduler(scheduler_pb2_grpc.SchedulerServicer):
    """Streams the token ids of FAKE_REPLY, one per event, with fake logprobs."""

    def __init__(self, reply_ids: list[int], eos_id: int):
        self.reply_ids = reply_ids
        self.eos_id = eos_id
        self.cancelled: list[str] = []
        self.running = 0
        self.requests: list[scheduler_pb2.SubmitRequest] = []

    def Submit(self, request, context):
        self.requests.append(request)
        n = len(request.prompt_token_ids)
        if n >= FAKE_CONTEXT:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"prompt has {n} tokens but the context holds {FAKE_CONTEXT}")
        if request.sampling.max_tokens < 1:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "max_tokens must be an integer >= 1")
        self.running += 1
        # an RPC that terminates before its last event was cancelled by the client, however
        # gRPC noticed it (during the sleep below, or when the next send failed)
        ended = {"normally": False}
        context.add_callback(lambda: ended["normally"] or self.cancelled.append(request.request_id))
        try:
            k = request.sampling.logprobs if request.sampling.HasField("logprobs") else -1
            first = True
            sent = 0
            ids = self.reply_ids + [self.eos_id]
            for i, tid in enumerate(ids):
                if request.sampling.max_tokens == 13 and i == 2:   # the worker "dies" mid-request
                    ended["normally"] = True
                    context.abort(grpc.StatusCode.UNAVAILABLE, "worker-0 at 127.0.0.1:1 is down (connection refused)")
                ev = scheduler_pb2.SubmitEvent()
                if first and request.HasField("prompt_logprobs"):
                    for t in request.prompt_token_ids[1:]:
                        ev.prompt_logprobs.add(token_id=t, logprob=-1.0,
                                               top_ids=[t, 0][:request.prompt_logprobs],
                                               top_logprobs=[-1.0, -2.0][:request.prompt_logprobs])
                first = False
                eos = tid == self.eos_id
                if not eos or request.sampling.ignore_eos:
                    te = ev.tokens.add(token_id=tid, logprob=-0.5)
                    if k > 0:
                        te.top_ids.extend([tid] + [1 + (tid + j) % 100 for j in range(k - 1)])
                        te.top_logprobs.extend([-0.5] + [-3.0 - j for j in range(k - 1)])
                    sent += 1
                if eos or sent >= request.sampling.max_tokens:
                    ev.finish_reason = common_pb2.FINISH_REASON_STOP if eos else common_pb2.FINISH_REASON_LENGTH
                    ev.usage.prompt_tokens = n
                    ev.usage.completion_tokens = sent
                    ev.usage.total_tokens = n + sent
                    ended["normally"] = True
                    yield ev
                    return
                yield ev
                time.sleep({77: 0.2, 40: 0.05}.get(request.sampling.max_tokens, 0.005))   # 77, 40: slow requests
                if not context.is_active():
                    return
        finally:
            self.running -= 1

    def Abort(self, request, context):
        return scheduler_pb2.AbortResponse(found=False)

    def Stats(self, request, context):
        return scheduler_pb2.StatsResponse(running=self.running, waiting=0, kv_blocks_total=100,
                                           kv_blocks_free=90, kv_used_fraction=0.1, block_size=16,
                                           max_context=FAKE_CONTEXT, status=common_pb2.SERVING_STATUS_SERVING)

    def RegisterWorker(self, request, context):
        return scheduler_pb2.RegisterWorkerResponse(accepted=False, message="fake scheduler")


# ----------------------------------------------------------------------------- process helpers
def _start(cmd: list[str], ready: Path, log: Path, name: str):
    return start_with_ready_file(cmd, ready, log, timeout=60, name=name, log_chars=3000)


class Stack:
    def __init__(self, kind: str, http: str, grpc_addr: str, fake: FakeScheduler | None, procs: list):
        self.kind, self.http, self.grpc, self.fake, self.procs = kind, http, grpc_addr, fake, procs
        self.base = f"http://{http}"

    def client(self, key: str | None = API_KEY) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.base + "/v1", api_key=key or "none", max_retries=0, timeout=60)


@pytest.fixture(scope="module", params=["fake", "real"])
def stack(request, tmp_path_factory):
    tmp = tmp_path_factory.mktemp(f"router-{request.param}")
    procs: list[subprocess.Popen] = []
    fake = server = None
    try:
        if request.param == "fake":
            from router.tokenizer import Tokenizer
            from shared.gguf_file import GGUFFile
            from shared.model_registry import resolve_model
            tok = Tokenizer.from_metadata(GGUFFile(resolve_model(MODEL)).metadata)
            fake = FakeScheduler(tok.encode(FAKE_REPLY), tok.eos_id)
            server = grpc.server(futures.ThreadPoolExecutor(8))
            scheduler_pb2_grpc.add_SchedulerServicer_to_server(fake, server)
            port = server.add_insecure_port("127.0.0.1:0")
            server.start()
            sched_addr = f"127.0.0.1:{port}"
        else:
            if not (ROOT / "scheduler" / "main.py").exists() or not (ROOT / "worker" / "main.py").exists():
                pytest.skip("scheduler/main.py or worker/main.py does not exist yet")
            try:
                w, winfo = _start([PY, "-m", "worker.main", "--model", MODEL, "--port", "0", "--kv-memory", "64MiB",
                                   "--ready-file", str(tmp / "w.json")], tmp / "w.json", tmp / "w.log", name="worker")
                procs.append(w)
                s, sinfo = _start([PY, "-m", "scheduler.main", "--worker", winfo["address"], "--port", "0",
                                   "--ready-file", str(tmp / "s.json")], tmp / "s.json", tmp / "s.log",
                                  name="scheduler")
                procs.append(s)
            except (RuntimeError, KeyError) as exc:
                pytest.skip(f"real worker/scheduler did not start: {exc}")
            sched_addr = sinfo["address"]
        r, rinfo = _start([PY, "-m", "router.main", "--model", MODEL, "--scheduler", sched_addr,
                           "--http-port", "0", "--grpc-port", "0", "--api-key", API_KEY,
                           "--ready-file", str(tmp / "r.json")], tmp / "r.json", tmp / "r.log", name="router")
        procs.append(r)
        yield Stack(request.param, rinfo["http"], rinfo["grpc"], fake, procs)
    finally:
        for p in reversed(procs):
            stop(p)
        if server is not None:
            server.stop(0)


def _post(stack: Stack, path: str, body, key: str | None = API_KEY, raw: bytes | None = None) -> httpx.Response:
    headers = {"content-type": "application/json"}
    if key:
        headers["authorization"] = f"Bearer {key}"
    data = raw if raw is not None else json.dumps(body).encode()
    return httpx.post(stack.base + path, content=data, headers=headers, timeout=60)


def _assert_alive(stack: Stack) -> None:
    r = httpx.get(stack.base + "/v1/models", headers={"authorization": f"Bearer {API_KEY}"}, timeout=10)
    assert r.status_code == 200, r.text
    assert r.json()["data"][0]["id"] == MODEL


# ----------------------------------------------------------------------------- HTTP via openai
def test_completion_and_chat_not_streamed(stack):
    c = stack.client()
    out = c.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0)
    assert out.choices[0].finish_reason in ("length", "stop")
    assert out.usage.completion_tokens <= 8 and out.usage.prompt_tokens > 3
    assert isinstance(out.choices[0].text, str) and out.choices[0].text
    chat = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Say hi"}],
                                     max_tokens=8, temperature=0, seed=1)
    assert chat.choices[0].message.role == "assistant"
    assert chat.choices[0].message.content
    assert chat.usage.total_tokens == chat.usage.prompt_tokens + chat.usage.completion_tokens
    if stack.kind == "fake":
        assert FAKE_REPLY.startswith(out.choices[0].text)
        # chat: template rendered and parsed with special tokens, no BOS added by the router
        sub = stack.fake.requests[-1]
        assert list(sub.prompt_token_ids)[:1] != [] and sub.sampling.max_tokens == 8


def test_streams_equal_non_streamed(stack):
    c = stack.client()
    kw = dict(model=MODEL, prompt="Once upon a time", max_tokens=10, temperature=0)
    full = c.completions.create(**kw).choices[0].text
    chunks = list(c.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
    assert text == full
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens >= 1
    assert any(ch.choices and ch.choices[0].finish_reason for ch in chunks)

    ckw = dict(model=MODEL, messages=[{"role": "user", "content": "Count to three"}], max_tokens=10, temperature=0)
    cfull = c.chat.completions.create(**ckw).choices[0].message.content
    cchunks = list(c.chat.completions.create(stream=True, **ckw))
    assert cchunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in cchunks if ch.choices) == cfull
    assert cchunks[-1].choices[0].finish_reason in ("length", "stop")


def test_raw_sse_ends_with_done(stack):
    with httpx.stream("POST", stack.base + "/v1/completions", timeout=60,
                      headers={"authorization": f"Bearer {API_KEY}"},
                      json={"model": MODEL, "prompt": "Hi", "max_tokens": 3, "stream": True}) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [ln for ln in r.iter_lines() if ln]
    assert lines[-1] == "data: [DONE]"
    assert all(ln.startswith("data: ") for ln in lines)


def test_logprobs_and_echo(stack):
    c = stack.client()
    out = c.completions.create(model=MODEL, prompt="Paris is in", max_tokens=4, temperature=0, logprobs=2,
                               echo=True)
    lp = out.choices[0].logprobs
    assert out.choices[0].text.startswith("Paris is in")
    n_prompt = out.usage.prompt_tokens
    assert len(lp.tokens) == n_prompt + out.usage.completion_tokens
    assert lp.token_logprobs[0] is None and all(x <= 0 for x in lp.token_logprobs[1:])
    assert lp.top_logprobs[0] is None and all(1 <= len(t) <= 2 for t in lp.top_logprobs[n_prompt:])
    assert lp.text_offset == sorted(lp.text_offset)

    chat = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=3,
                                     temperature=0, logprobs=True, top_logprobs=3)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    assert all(len(t.top_logprobs) == 3 and t.logprob <= 0 and isinstance(t.bytes, list) for t in content)


def test_stop_strings(stack):
    c = stack.client()
    if stack.kind == "fake":
        before = len(stack.fake.cancelled)
        out = c.completions.create(model=MODEL, prompt="x", max_tokens=40, stop=["STOP"])
        assert out.choices[0].text == FAKE_REPLY.split("STOP")[0]
        assert out.choices[0].finish_reason == "stop"
        chunks = list(c.completions.create(model=MODEL, prompt="x", max_tokens=40, stop="fake sched", stream=True))
        assert "".join(ch.choices[0].text for ch in chunks) == FAKE_REPLY.split("fake sched")[0]
        # both upstream streams were cancelled once their stop string matched
        deadline = time.time() + 10
        while len(stack.fake.cancelled) < before + 2 and time.time() < deadline:
            time.sleep(0.05)
        assert len(stack.fake.cancelled) == before + 2
    else:
        base = c.completions.create(model=MODEL, prompt="1, 2, 3,", max_tokens=12, temperature=0).choices[0].text
        assert len(base.strip()) > 2
        stop = base.strip()[1:3]
        out = c.completions.create(model=MODEL, prompt="1, 2, 3,", max_tokens=12, temperature=0, stop=[stop])
        assert stop not in out.choices[0].text
        assert out.choices[0].text == base[:base.index(stop)]
        assert out.choices[0].finish_reason == "stop"


def test_penalties_seed_ignore_eos_pass_through(stack):
    c = stack.client()
    out = c.completions.create(model=MODEL, prompt="Hi", max_tokens=5, temperature=0.7, top_p=0.9, seed=7,
                               presence_penalty=0.5, frequency_penalty=0.5, extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 5
    if stack.kind == "fake":
        s = stack.fake.requests[-1].sampling
        assert (s.seed, s.ignore_eos, round(s.presence_penalty, 3), round(s.top_p, 3)) == (7, True, 0.5, 0.9)


# ----------------------------------------------------------------------------- bad requests
def test_bad_requests_get_4xx_and_server_keeps_serving(stack):
    r = _post(stack, "/v1/completions", None, raw=b"{not json")
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    r = _post(stack, "/v1/completions", {"model": "nope", "prompt": "hi"})
    assert r.status_code == 404 and MODEL in r.json()["error"]["message"]
    r = _post(stack, "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": -1})
    assert r.status_code == 400 and "max_tokens" in r.json()["error"]["message"]
    r = _post(stack, "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                              "temperature": 5})
    assert r.status_code == 400 and "temperature" in r.json()["error"]["message"]
    r = _post(stack, "/v1/completions", {"model": MODEL, "prompt": "hi", "n": 2})
    assert r.status_code == 400 and "n=1" in r.json()["error"]["message"]
    r = _post(stack, "/v1/completions", {"model": MODEL, "prompt": "hello " * 9000, "max_tokens": 2})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "context_length_exceeded"
    nums = [int(w) for w in err["message"].replace(",", " ").split() if w.isdigit()]
    assert len(nums) >= 2 and nums[0] > nums[1], err["message"]
    for e in (err,):
        assert set(e) == {"message", "type", "param", "code"}
    with pytest.raises(openai.BadRequestError):
        stack.client().completions.create(model=MODEL, prompt="x", max_tokens=-5)
    with pytest.raises(openai.NotFoundError):
        stack.client().chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "x"}])
    _assert_alive(stack)
    assert stack.client().completions.create(model=MODEL, prompt="still", max_tokens=2).choices[0].text


def test_api_key_http_and_grpc(stack):
    with pytest.raises(openai.AuthenticationError):
        stack.client(key="wrong").completions.create(model=MODEL, prompt="x", max_tokens=2)
    r = _post(stack, "/v1/completions", {"model": MODEL, "prompt": "x"}, key=None)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    with grpc.insecure_channel(stack.grpc) as ch:
        stub = router_pb2_grpc.GenerationStub(ch)
        with pytest.raises(grpc.RpcError) as ei:
            list(stub.Generate(router_pb2.GenerateRequest(text="x"), timeout=10))
        assert ei.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as ei:
            stub.ListModels(router_pb2.ListModelsRequest(), timeout=10, metadata=[("authorization", "Bearer no")])
        assert ei.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_reflection_lists_and_calls_generation_behind_the_key(stack):
    """A generic client (grpcio-reflection's own descriptor database, no generated stubs of ours)
    lists the services, builds GenerateRequest from the served descriptors and calls Generate;
    without the key reflection is refused, while the standard health check answers."""
    from google.protobuf import descriptor_pool, json_format, message_factory
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase
    md = [("authorization", f"Bearer {API_KEY}")]
    with grpc.insecure_channel(stack.grpc) as ch:
        with pytest.raises(grpc.RpcError) as ei:
            ProtoReflectionDescriptorDatabase(ch).get_services()
        assert ei.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert grpc_health.check(stack.grpc)

    authed = grpc.intercept_channel(grpc.insecure_channel(stack.grpc), _MetadataAdder(md))
    database = ProtoReflectionDescriptorDatabase(authed)
    services = set(database.get_services())
    assert {"tensorserve.v1.Generation", "grpc.health.v1.Health"} <= services
    pool = descriptor_pool.DescriptorPool(database)
    method = pool.FindServiceByName("tensorserve.v1.Generation").FindMethodByName("Generate")
    request_class = message_factory.GetMessageClass(method.input_type)
    response_class = message_factory.GetMessageClass(method.output_type)
    request = json_format.ParseDict({"model": MODEL, "text": "The sky is",
                                     "sampling": {"max_tokens": 3, "temperature": 0}}, request_class())
    call = authed.unary_stream("/tensorserve.v1.Generation/Generate", request_serializer=request_class.SerializeToString,
                               response_deserializer=response_class.FromString)
    events = [json_format.MessageToDict(e) for e in call(request, timeout=60)]
    assert "finish" in events[-1] and int(events[-1]["finish"]["usage"]["completionTokens"]) == 3   # uint64: a JSON string
    authed.close()


class _MetadataAdder(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                     grpc.StreamStreamClientInterceptor):
    """Adds the API key to every call, as a generic client's header option does."""

    def __init__(self, metadata):
        self.metadata = list(metadata)

    def _details(self, details):
        return details._replace(metadata=list(details.metadata or []) + self.metadata)

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_stream_stream(self, continuation, details, requests):
        return continuation(self._details(details), requests)


# ----------------------------------------------------------------------------- gRPC
def test_grpc_generate_tokenize_models(stack):
    md = [("authorization", f"Bearer {API_KEY}")]
    with grpc.insecure_channel(stack.grpc) as ch:
        stub = router_pb2_grpc.GenerationStub(ch)
        req = router_pb2.GenerateRequest(model=MODEL, text="The sky is",
                                         sampling=common_pb2.SamplingParams(max_tokens=6, temperature=0, logprobs=1))
        events = list(stub.Generate(req, metadata=md, timeout=60))
        deltas = [e.delta for e in events if e.WhichOneof("event") == "delta"]
        fin = events[-1].finish
        assert events[-1].WhichOneof("event") == "finish"
        assert fin.finish_reason in (common_pb2.FINISH_REASON_LENGTH, common_pb2.FINISH_REASON_STOP)
        n = sum(len(d.token_ids) for d in deltas)
        assert n == fin.usage.completion_tokens and 1 <= n <= 6
        assert all(len(d.logprobs) == len(d.token_ids) for d in deltas)
        text = "".join(d.text for d in deltas)
        ids = [t for d in deltas for t in d.token_ids]
        detok = stub.Detokenize(router_pb2.DetokenizeRequest(token_ids=ids, skip_special_tokens=True),
                                metadata=md, timeout=10)
        assert detok.text == text
        # chat prompt
        chat = router_pb2.GenerateRequest(chat=router_pb2.ChatMessages(messages=[
            router_pb2.ChatMessage(role="user", content="Hi")]), sampling=common_pb2.SamplingParams(max_tokens=3))
        assert list(stub.Generate(chat, metadata=md, timeout=60))[-1].WhichOneof("event") == "finish"
        tok = stub.Tokenize(router_pb2.TokenizeRequest(text="hello world"), metadata=md, timeout=10)
        assert len(tok.token_ids) >= 2 and tok.max_context > 0
        models = stub.ListModels(router_pb2.ListModelsRequest(), metadata=md, timeout=10)
        assert models.models[0].id == MODEL and models.models[0].vocab_size > 1000
        # bad request: INVALID_ARGUMENT with a message
        bad = router_pb2.GenerateRequest(text="x", sampling=common_pb2.SamplingParams(temperature=5))
        with pytest.raises(grpc.RpcError) as ei:
            list(stub.Generate(bad, metadata=md, timeout=10))
        assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "temperature" in ei.value.details()
        # the standard health service answers without the key, for the server and the API
        assert grpc_health.check(stack.grpc) and grpc_health.check(stack.grpc, "tensorserve.v1.Generation")


# ----------------------------------------------------------------------------- health, metrics, models
def test_health_models_metrics(stack):
    r = httpx.get(stack.base + "/health", timeout=10)
    assert r.status_code == 200 and r.json()["status"] == "ok"
    _assert_alive(stack)
    stack.client().completions.create(model=MODEL, prompt="metrics", max_tokens=3)
    m = httpx.get(stack.base + "/metrics", timeout=10)
    assert m.status_code == 200
    for name in ("tensorserve_requests_total", "tensorserve_prompt_tokens_total",
                 "tensorserve_generation_tokens_total", "tensorserve_time_to_first_token_seconds_bucket",
                 "tensorserve_inter_token_latency_seconds_bucket", "tensorserve_num_requests_waiting",
                 "tensorserve_kv_cache_usage_ratio"):
        assert name in m.text, name
    assert 'endpoint="/v1/completions",status="200"' in m.text


def test_multi_turn_chat_reuses_the_previous_turn(stack):
    if stack.kind != "real":
        pytest.skip("the prefix cache lives in the real scheduler")
    c = stack.client()
    system = ("You are a patient tutor for a class of eleven-year-olds learning about the water cycle, "
              "weather, rivers and oceans. Answer in two short sentences, use simple words, and end "
              "every answer with a question that makes the student think about their own town.")
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "Why does it rain?"}]
    first = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "And where does the water go after that?"}]
    second = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0)
    cached = second.usage.prompt_tokens_details.cached_tokens
    # at least the first turn's prompt, in whole 16-token blocks, came from the prefix cache
    assert (first.usage.prompt_tokens // 16) * 16 <= cached < second.usage.prompt_tokens
    m = httpx.get(stack.base + "/metrics", timeout=10).text
    hits = [line for line in m.splitlines() if line.startswith("tensorserve_prefix_cache_hits_total")]
    assert hits and float(hits[0].split()[-1]) >= cached
    assert "tensorserve_prefix_cache_queries_total" in m and "tensorserve_kv_blocks_cached" in m


def test_error_mid_stream_ends_the_stream_with_an_error(stack):
    if stack.kind != "fake":
        pytest.skip("needs the fake scheduler's failure injection")
    c = stack.client()
    with pytest.raises(openai.APIError) as ei:
        for _ in c.completions.create(model=MODEL, prompt="x", max_tokens=13, stream=True):
            pass
    assert "worker-0" in str(ei.value)
    with pytest.raises(openai.APIStatusError) as ei:
        c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=13)
    assert ei.value.status_code == 503 and "worker-0" in str(ei.value)
    _assert_alive(stack)


def test_client_disconnect_cancels_upstream(stack):
    if stack.kind != "fake":
        pytest.skip("the fake scheduler records cancellations")
    before = len(stack.fake.cancelled)
    with httpx.stream("POST", stack.base + "/v1/completions", timeout=30,
                      headers={"authorization": f"Bearer {API_KEY}"},
                      json={"model": MODEL, "prompt": "x", "max_tokens": 77, "stream": True}) as r:
        next(r.iter_lines())
    with grpc.insecure_channel(stack.grpc) as ch:
        stub = router_pb2_grpc.GenerationStub(ch)
        call = stub.Generate(router_pb2.GenerateRequest(text="x", sampling=common_pb2.SamplingParams(max_tokens=77)),
                             metadata=[("authorization", f"Bearer {API_KEY}")], timeout=30)
        next(call)
        call.cancel()
    deadline = time.time() + 5
    while len(stack.fake.cancelled) < before + 2 and time.time() < deadline:
        time.sleep(0.05)
    assert len(stack.fake.cancelled) >= before + 2


# ----------------------------------------------------------------------------- stop strings (unit)
def test_stop_string_matcher_holds_back_possible_starts():
    from router.frontend import StopStringMatcher
    m = StopStringMatcher(["END", "\n\n"])
    out = [m.push(t) for t in ["Hello E", "N", "x", " wor", "ld\n", "\nmore"]]
    assert out == ["Hello ", "", "ENx", " wor", "ld", ""]
    assert m.matched == "\n\n" and m.flush() == ""
    m = StopStringMatcher(["abc"])
    assert m.push("xxab") == "xx" and m.flush() == "ab" and m.matched is None
    m = StopStringMatcher([])
    assert m.push("abc") == "abc"


# ----------------------------------------------------------------------------- scheduler down, no chat template
def test_scheduler_down_gives_503_not_a_hang(tmp_path):
    # a port nothing listens on
    dead = f"127.0.0.1:{free_port()}"
    r, info = _start([PY, "-m", "router.main", "--model", "gemma3-270m", "--scheduler", dead, "--http-port", "0",
                      "--grpc-port", "0", "--unavailable-timeout", "3", "--ready-file", str(tmp_path / "r.json")],
                     tmp_path / "r.json",
                     tmp_path / "r.log", name="router")
    try:
        base = f"http://{info['http']}"
        t = time.time()
        h = httpx.get(base + "/health", timeout=20)
        assert h.status_code == 503 and h.json()["message"]
        c = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0, timeout=30)
        with pytest.raises(openai.APIStatusError) as ei:
            c.completions.create(model="gemma3-270m", prompt="hi", max_tokens=2)
        assert ei.value.status_code == 503 and "unavailable" in str(ei.value)
        assert 3 <= time.time() - t < 15          # waited --unavailable-timeout for it to come back, then said so
        assert httpx.get(base + "/metrics", timeout=10).status_code == 200
        # gemma3-270m (base model) has no chat template: 400 with ChatTemplateMissing's message
        with pytest.raises(openai.BadRequestError) as ei:
            c.chat.completions.create(model="gemma3-270m", messages=[{"role": "user", "content": "x"}])
        assert "no chat template" in str(ei.value)
    finally:
        stop(r)
    assert r.returncode == 0, "SIGTERM should stop the router cleanly"
