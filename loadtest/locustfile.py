"""Locust load test of TensorServe's two public APIs, each user streaming its answers.

Users (selectable by tag; without --tags both run, locust splits the users between them):

  http  HttpStreamUser: streamed POST /v1/chat/completions and /v1/completions (SSE), against --host.
  grpc  GrpcStreamUser: streamed tensorserve.v1.Generation/Generate, chat and text prompts, against
        --grpc-target HOST:PORT (or the environment variable LOCUST_GRPC_TARGET).

Each request is reported three ways, as locust entries of their own (Type / Name in the stats):

  POST  /v1/chat/completions, /v1/completions   the whole streamed request (http)
  grpc  Generate chat, Generate text             the whole streamed call (grpc)
  TTFT  http chat, http completions, grpc chat, grpc text
        time to first token: from sending the request to the first chunk that carries generated
        text (http) or tokens (grpc)
  ITL   same names: inter-token latency, one entry per gap between consecutive such chunks (a
        chunk may carry several tokens, e.g. with --num-decode-steps > 1: then there are fewer,
        longer gaps)

A request fails when the HTTP status is not 200, the stream carries an error object, it does not
end with `data: [DONE]` (http) or with a finish event (grpc), the finish event reports an error, or
the connection or call fails. TTFT and ITL entries are reported for successful requests only.

With --disconnect-share S, that share of requests (both APIs) leave on purpose: the client closes
the stream (HTTP: closes the connection; gRPC: cancels the call) after 1-4 chunks with content, as a
client that goes away mid-answer. Such a request counts as a success, under names of its own:
"/v1/chat/completions (left early)", "Generate chat (left early)", and TTFT / ITL
"http chat (left early)" etc. (A stream that ends before the chosen number of chunks is an
ordinary request.) Requests time out after --request-timeout s (default 300: on a loaded 2-core
machine a request may wait long in the queue, which is not a failure).

With --request-log FILE (or the environment variable LOCUST_REQUEST_LOG) every request that ends
(not those cut off when locust stops its users) is appended to FILE as one JSON line: api, name,
start and end (wall-clock, time.time()), ok, left_early, error, ttft_ms and itl_ms (the gaps).
loadtest/soak.py uses it to tell which failures were in flight at a given moment.

Prompts mix short questions with a few hundred tokens of random common words (about one token a
word for SmolLM2), drawn fresh per request so the prefix cache does not make them cheap. Requests
are greedy with `ignore_eos` (an extension TensorServe, vLLM and llama.cpp accept), so every
answer is --max-tokens long (default 24) and shows up to max_tokens - 1 gaps (fewer where a chunk
carries several tokens, or text waits for the rest of a character).

Options this file adds to locust's: --grpc-target, --served-model (default: the first model the
server lists), --max-tokens, --long-share (of requests with a long prompt, default 0.25),
--disconnect-share (default 0), --request-timeout (default 300 s), --request-log.

Run it through `make loadtest` / loadtest/run_locust.py, which starts a server, or by hand
against a running one:

    locust -f loadtest/locustfile.py --headless -u 8 -r 4 -t 60s \\
        --host http://127.0.0.1:8000 --grpc-target 127.0.0.1:50051 [--tags http|grpc] --csv out/locust
"""
from __future__ import annotations

import json
import os
import random
import time

# locust monkey-patches the standard library for gevent when it is imported; grpc's C core has its
# own threads and polling, and must be told to cooperate with gevent before any channel is made.
from grpc.experimental import gevent as grpc_gevent

grpc_gevent.init_gevent()

import gevent  # noqa: E402
import grpc  # noqa: E402
from locust import HttpUser, User, between, events, tag, task  # noqa: E402
from locust.stats import CSV_STATS_INTERVAL_SEC  # noqa: E402

from protos.tensorserve.v1 import common_pb2, router_pb2, router_pb2_grpc  # noqa: E402

GRPC_TARGET_ENV = "LOCUST_GRPC_TARGET"
REQUEST_LOG_ENV = "LOCUST_REQUEST_LOG"
DEFAULT_MAX_TOKENS = 24
REQUEST_TIMEOUT_S = 300
LEFT_EARLY = " (left early)"   # suffix of the names of requests whose client left on purpose
LEAVE_AFTER_CHUNKS = (1, 4)    # such a client closes the stream after this many chunks with content

WORDS = ("time year people way day man thing woman life child world school state family student group "
         "country problem hand part place case week company system program question work government number "
         "night point home water room mother area money story fact month lot right study book eye job word "
         "business issue side kind head house service friend father power hour game line end member law car "
         "city community name president team minute idea kid body information back parent face others level "
         "office door health person art war history party result change morning reason research girl guy "
         "moment air teacher force education light green river stone garden music table window paper bread "
         "apple orange blue red small large old new good great little long high early young important").split()
QUESTIONS = [
    "What is the capital of France?",
    "Name three colours.",
    "Write one sentence about the sea.",
    "Give me a word that rhymes with cat.",
    "Why is the sky blue?",
    "Count from one to ten.",
    "Tell me a short fact about the moon.",
    "What do bees make?",
]
LONG_SHARE = 0.25          # of requests, with a long prompt
LONG_WORDS = (200, 400)    # words (~tokens) in a long prompt


@events.init_command_line_parser.add_listener
def _add_arguments(parser):
    group = parser.add_argument_group("TensorServe", "options of loadtest/locustfile.py")
    group.add_argument("--grpc-target", default=os.environ.get(GRPC_TARGET_ENV, ""), metavar="HOST:PORT",
                       help=f"the router's gRPC address, for the grpc user [env {GRPC_TARGET_ENV}]")
    group.add_argument("--served-model", default="",
                       help="model name to send (default: the first one the server lists)")
    group.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS,
                       help=f"tokens generated per request (default {DEFAULT_MAX_TOKENS})")
    group.add_argument("--long-share", type=float, default=LONG_SHARE,
                       help=f"share of requests with a long prompt of {LONG_WORDS[0]}-{LONG_WORDS[1]} random "
                            f"words, the others being short questions (default {LONG_SHARE})")
    group.add_argument("--disconnect-share", type=float, default=0.0,
                       help=f"share of requests whose client closes the stream after {LEAVE_AFTER_CHUNKS[0]}-"
                            f"{LEAVE_AFTER_CHUNKS[1]} chunks with content, reported as successes under names "
                            f"ending in '{LEFT_EARLY}' (default 0)")
    group.add_argument("--request-timeout", type=float, default=REQUEST_TIMEOUT_S,
                       help=f"seconds a request may take (HTTP: between two reads; gRPC: the whole call; "
                            f"default {REQUEST_TIMEOUT_S})")
    group.add_argument("--request-log", default=os.environ.get(REQUEST_LOG_ENV, ""), metavar="FILE",
                       help=f"append one JSON line per ended request to FILE [env {REQUEST_LOG_ENV}]")


def _option(environment, name: str, default):
    """A command line option of this file; the default where locust runs as a library without them."""
    value = getattr(environment.parsed_options, name, None) if environment.parsed_options else None
    return default if value is None else value


@events.test_start.add_listener
def _drop_users_without_tasks(environment, **_kwargs):
    """--tags filters tasks, not users: with --tags http the gRPC user would still be spawned, with no
    task left, and fail. Locust filters the tasks just before test_start, and builds its dispatcher of
    users after it: drop the users the tags left empty there (all, if none has a task left)."""
    keep = [user for user in environment.user_classes if user.tasks]
    if keep and len(keep) < len(environment.user_classes):
        environment.user_classes[:] = keep


@events.quitting.add_listener
def _last_csv_pass(environment, **_kwargs):
    """Locust rewrites its CSV files once a second and not again at the end, so requests that ended in
    the last second (users finishing within --stop-timeout) would be missing from PREFIX_stats.csv while
    the printed summary has them: let the writer make one more pass, after the last request."""
    if _option(environment, "csv_prefix", None):
        gevent.sleep(CSV_STATS_INTERVAL_SEC + 0.5)


class _RequestLog:
    """The --request-log file of this locust process, opened on first use (append, one line a request)."""

    def __init__(self) -> None:
        self.path: str | None = None
        self.file = None

    def write(self, environment, record: dict) -> None:
        path = _option(environment, "request_log", "") or os.environ.get(REQUEST_LOG_ENV, "")
        if not path:
            return
        if self.file is None or path != self.path:
            self.path, self.file = path, open(path, "a", buffering=1)
        self.file.write(json.dumps(record) + "\n")      # one write per line: greenlets do not interleave


_request_log = _RequestLog()


def _leave_after(rng: random.Random, share: float) -> int | None:
    """Content chunks after which this request's client leaves on purpose; None: it reads to the end."""
    return rng.randint(*LEAVE_AFTER_CHUNKS) if share > 0 and rng.random() < share else None


def _random_words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def make_prompt(rng: random.Random, long_share: float = LONG_SHARE) -> str:
    """A short question, or (with probability long_share) a few hundred random words and a question."""
    if rng.random() < long_share:
        words = _random_words(rng, rng.randint(*LONG_WORDS))
        return f"Here is a list of words: {words}\nWhich word comes up most often in the list?"
    return rng.choice(QUESTIONS)


class _Timing:
    """TTFT and inter-token gaps of one streamed request, in milliseconds."""

    def __init__(self) -> None:
        self.wall_start = time.time()
        self.start = time.perf_counter()
        self.last: float | None = None
        self.chunks = 0               # chunks with content so far
        self.ttft: float | None = None
        self.gaps: list[float] = []

    def token(self) -> None:
        now = time.perf_counter()
        if self.last is None:
            self.ttft = (now - self.start) * 1000
        else:
            self.gaps.append((now - self.last) * 1000)
        self.last = now
        self.chunks += 1

    def elapsed_ms(self) -> float:
        return (time.perf_counter() - self.start) * 1000

    def report(self, environment, name: str) -> None:
        fire = environment.events.request.fire
        if self.ttft is not None:
            fire(request_type="TTFT", name=name, response_time=self.ttft, response_length=0, exception=None,
                 context={})
        for gap in self.gaps:
            fire(request_type="ITL", name=name, response_time=gap, response_length=0, exception=None, context={})

    def log(self, environment, api: str, name: str, error, left_early: bool) -> None:
        _request_log.write(environment, {
            "api": api, "name": name, "start": self.wall_start, "end": time.time(), "ok": error is None,
            "left_early": left_early, "error": None if error is None else str(error)[:300],
            "ttft_ms": None if self.ttft is None else round(self.ttft, 2),
            "itl_ms": [round(g, 2) for g in self.gaps]})


class StreamError(Exception):
    """A streamed request that did not complete as it should."""


class HttpStreamUser(HttpUser):
    """OpenAI-compatible HTTP API, streamed (SSE)."""

    wait_time = between(0.05, 0.5)
    model: str | None = None

    def on_start(self) -> None:
        self.rng = random.Random()
        self.max_tokens = _option(self.environment, "max_tokens", DEFAULT_MAX_TOKENS)
        self.long_share = _option(self.environment, "long_share", LONG_SHARE)
        self.disconnect_share = _option(self.environment, "disconnect_share", 0.0)
        self.timeout = _option(self.environment, "request_timeout", REQUEST_TIMEOUT_S)
        if HttpStreamUser.model is None:
            HttpStreamUser.model = _option(self.environment, "served_model", "") or self._listed_model()

    def _listed_model(self) -> str:
        with self.client.get("/v1/models", name="/v1/models", catch_response=True,
                             timeout=self.timeout) as resp:
            try:
                return resp.json()["data"][0]["id"]
            except Exception as exc:  # noqa: BLE001 - reported as the request's failure
                resp.failure(f"GET /v1/models: no model listed ({exc!r}, status {resp.status_code})")
                return "smollm2-135m"

    def _stream(self, path: str, label: str, body: dict, content) -> None:
        body = {**body, "model": self.model, "stream": True, "max_tokens": self.max_tokens, "temperature": 0,
                "ignore_eos": True}
        leave_after = _leave_after(self.rng, self.disconnect_share)
        left = False
        timing = _Timing()
        size = 0
        with self.client.post(path, json=body, stream=True, catch_response=True, name=path,
                              timeout=self.timeout) as resp:
            try:
                if resp.status_code != 200:
                    raise StreamError(f"status {resp.status_code}: {resp.error or (resp.text or '')[:300]}")
                done = False
                for line in resp.iter_lines():
                    size += len(line) + 1
                    if not line:
                        continue
                    if done:
                        raise StreamError(f"data after [DONE]: {line[:200]!r}")
                    if not line.startswith(b"data:"):
                        continue                              # SSE comments and other fields
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        done = True
                        continue
                    event = json.loads(data)
                    if "error" in event:
                        raise StreamError(f"error in stream: {json.dumps(event['error'])[:300]}")
                    if any(content(choice) for choice in event.get("choices", ())):
                        timing.token()
                        if leave_after is not None and timing.chunks >= leave_after:
                            left = True           # leave mid-stream: the finally below drops the connection
                            break
                if not done and not left:
                    raise StreamError("stream ended without data: [DONE]")
                if timing.ttft is None:
                    raise StreamError("no content in the stream")
            except Exception as exc:  # noqa: BLE001 - any failure while reading is the request's failure
                resp.failure(exc if isinstance(exc, StreamError) else StreamError(f"{type(exc).__name__}: {exc}"))
            else:
                resp.success()
            finally:
                resp.close()       # also when the user is stopped mid-stream (GreenletExit): drop the connection
            # the whole streamed request, not only the time to its headers
            resp.request_meta["response_time"] = timing.elapsed_ms()
            resp.request_meta["response_length"] = size
            if left:
                resp.request_meta["name"] = path + LEFT_EARLY
        error = resp.request_meta.get("exception")
        label += LEFT_EARLY if left else ""
        if error is None:
            timing.report(self.environment, label)
        timing.log(self.environment, "http", resp.request_meta["name"], error, left)

    @tag("http")
    @task
    def chat(self) -> None:
        prompt = make_prompt(self.rng, self.long_share)
        self._stream("/v1/chat/completions", "http chat", {"messages": [{"role": "user", "content": prompt}]},
                     lambda choice: (choice.get("delta") or {}).get("content"))

    @tag("http")
    @task
    def completions(self) -> None:
        prompt = make_prompt(self.rng, self.long_share)
        self._stream("/v1/completions", "http completions", {"prompt": prompt}, lambda choice: choice.get("text"))


class GrpcStreamUser(User):
    """tensorserve.v1.Generation/Generate, server streaming, over a channel of its own."""

    wait_time = between(0.05, 0.5)
    model: str | None = None

    def on_start(self) -> None:
        self.rng = random.Random()
        self.target = _option(self.environment, "grpc_target", "") or os.environ.get(GRPC_TARGET_ENV, "")
        self.max_tokens = _option(self.environment, "max_tokens", DEFAULT_MAX_TOKENS)
        self.long_share = _option(self.environment, "long_share", LONG_SHARE)
        self.disconnect_share = _option(self.environment, "disconnect_share", 0.0)
        self.timeout = _option(self.environment, "request_timeout", REQUEST_TIMEOUT_S)
        if not self.target:
            raise RuntimeError(f"the grpc user needs --grpc-target HOST:PORT or {GRPC_TARGET_ENV}")
        self.channel = grpc.insecure_channel(self.target)
        self.stub = router_pb2_grpc.GenerationStub(self.channel)
        if GrpcStreamUser.model is None:
            GrpcStreamUser.model = _option(self.environment, "served_model", "") or self._listed_model()

    def on_stop(self) -> None:
        channel = getattr(self, "channel", None)
        if channel is not None:
            channel.close()

    def _listed_model(self) -> str:
        start = time.perf_counter()
        exc, model = None, "smollm2-135m"
        try:
            model = self.stub.ListModels(router_pb2.ListModelsRequest(), timeout=self.timeout).models[0].id
        except Exception as e:  # noqa: BLE001
            exc = e
        self.environment.events.request.fire(request_type="grpc", name="ListModels", exception=exc,
                                             response_time=(time.perf_counter() - start) * 1000,
                                             response_length=0, context={})
        return model

    def _generate(self, name: str, label: str, **prompt) -> None:
        request = router_pb2.GenerateRequest(
            model=self.model, **prompt,
            sampling=common_pb2.SamplingParams(max_tokens=self.max_tokens, temperature=0, ignore_eos=True))
        leave_after = _leave_after(self.rng, self.disconnect_share)
        left = False
        timing = _Timing()
        size, exc, ended = 0, None, False
        call = None
        try:
            call = self.stub.Generate(request, timeout=self.timeout)
            finish = None
            for event in call:
                size += event.ByteSize()
                which = event.WhichOneof("event")
                if finish is not None:
                    raise StreamError(f"{which} event after the finish event")
                if which == "delta":
                    if event.delta.token_ids:
                        timing.token()
                        if leave_after is not None and timing.chunks >= leave_after:
                            left = True
                            break             # leave mid-stream: the finally below cancels the call
                elif which == "finish":
                    finish = event.finish
            if not left:
                if finish is None:
                    raise StreamError("stream ended without a finish event")
                if finish.finish_reason == common_pb2.FINISH_REASON_ERROR or finish.HasField("error"):
                    raise StreamError(f"finish {common_pb2.FinishReason.Name(finish.finish_reason)}: "
                                      f"{finish.error.code}: {finish.error.message}")
            if timing.ttft is None:
                raise StreamError("no tokens in the stream")
            ended = not left                        # a client that left cancels its call below
        except grpc.RpcError as e:
            exc = StreamError(f"{e.code().name}: {e.details()}")
        except Exception as e:  # noqa: BLE001
            exc = e if isinstance(e, StreamError) else StreamError(f"{type(e).__name__}: {e}")
        finally:
            if call is not None and not ended:     # failed, left, or the user was stopped mid-stream: abort it
                call.cancel()
        if left and exc is None:
            name, label = name + LEFT_EARLY, label + LEFT_EARLY
        self.environment.events.request.fire(request_type="grpc", name=name,
                                             response_time=timing.elapsed_ms(), response_length=size,
                                             exception=exc, context={})
        if exc is None:
            timing.report(self.environment, label)
        timing.log(self.environment, "grpc", name, exc, left)

    @tag("grpc")
    @task
    def chat(self) -> None:
        prompt = make_prompt(self.rng, self.long_share)
        self._generate("Generate chat", "grpc chat", chat=router_pb2.ChatMessages(
            messages=[router_pb2.ChatMessage(role="user", content=prompt)]))

    @tag("grpc")
    @task
    def text(self) -> None:
        prompt = make_prompt(self.rng, self.long_share)
        self._generate("Generate text", "grpc text", text=prompt)
