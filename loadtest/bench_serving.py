"""Serving benchmark for any OpenAI-compatible server, in the manner of vLLM's
benchmarks/benchmark_serving.py: streaming POST /v1/completions, greedy,
ignore_eos, max_tokens 64.

Workloads:
  random         for each concurrency c (default 1,4,16,32), max(8, 2c) requests,
                 at most c in flight (closed loop, all queued at t0). Prompts are
                 ~128 tokens (127 words) of random words, distinct from the first word on and
                 fresh each run, so no prefix cache can help. Reported per level:
                 output tok/s (all output tokens / wall time of the level), TTFT
                 p50/p99, ITL p50/p99 (gaps between streamed content chunks, pooled
                 over the level), failures, mean prompt tokens.
  long_prompt    8 streams decode (--long-streams), then one fresh ~8000-token prompt arrives
                 (--long-words): its time to first token, and the ITL p50/p99 of the
                 streams while it is prefilled (loadtest/long_prompt.py); the streams are
                 cancelled once it has its first token. Not in the default workloads.
  shared_prefix  one fresh ~1000-token system prompt plus short distinct questions,
                 5 requests one after another: ttft_cold_s (the first) against
                 ttft_warm_s (median of the other four) shows what prefix caching
                 buys; cached_tokens is what the server says it reused, if it says.
A warm-up request runs first and is not counted. A failed request is counted and
its error reported; if every request fails the exit status is 1.

Output tokens come from usage.completion_tokens (stream_options.include_usage),
or, where the server sends no usage, from the number of content chunks. ITL is
per chunk: a server that puts several tokens in one chunk shows fewer, longer gaps.
The words are common ones, mostly one token each for SmolLM2: the defaults
--prompt-words 127 --prefix-words 975 give ~128 and ~1000 prompt tokens.

Against TensorServe, started here (`tensorserve serve` on free ports, stopped at the end):
    python loadtest/bench_serving.py [--concurrency 1,4,16,32] [--json] [--out r.json]
    python loadtest/bench_serving.py --serve-arg=--max-num-batched-tokens=256

Against a running server, e.g. llama.cpp's llama-server (each streamed chunk is one
token there; it maps max_tokens and accepts ignore_eos):
    llama-server -m MODEL.gguf -t 2 -np 32 -c 32768 --port 8080
    python loadtest/bench_serving.py --base http://127.0.0.1:8080
The model name sent defaults to the first one GET /v1/models lists.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import long_prompt  # noqa: E402  (beside this file)

ROOT = Path(__file__).resolve().parents[1]
MODEL = "smollm2-135m"
DONE = "[DONE]"

WORDS = """
about above across act add after again against age ago air all almost alone along already also always among and animal
answer any appear apple area arm around art ask back bad ball bank base bear beat bed before begin behind believe bell
best better between big bird black blue board boat body bone book both box boy bread break bright bring brother brown
build burn busy buy call came camp can car care carry case cat catch cause cell center chair chance change charge check
child choose church circle city class clean clear climb clock close cloud coast coat cold color come common cook corn
corner cost count country course cover cow cross crowd cry cut dance dark day dead deal dear death decide deep desk
dinner direct doctor dog door double down draw dream dress drink drive drop dry during early earth east easy eat edge
egg eight end enemy energy enough enter equal even evening event ever every exact face fact fair fall family far farm
fast father fear feel field fight fill final find fine finger fire first fish five floor flower fly follow food foot
forest form four free fresh friend front fruit full game garden gas gate gather gentle gift girl give glad glass gold
good grass great green ground group grow guess hair half hand happy hard hat head hear heart heat heavy help high hill
history hold hole home hope horse hot hour house huge hunt ice idea inch iron island job join jump just keep key kind
king kitchen knee know lady lake land large last late laugh law lead leaf learn leave left leg letter level light like
line lion list little live long look lost loud love low machine main make man map mark market matter meat meet metal
middle mile milk mind minute miss money month moon morning mother mountain mouth move music name nation near neck need
never new next night nine noise north nose note number ocean offer office old open orange order other paint paper park
part party pass past path pay people pick picture piece place plain plan plant play point poor post pound power press
pretty print problem pull push quick quiet race rain raise reach read ready real red remember rest rich ride right ring
river road rock roll room root rope rose round row rule run safe salt sand save say school sea season seat second seed
sell send serve seven shape share sharp sheep shell ship shoe shop short shoulder show side sign silver simple sing
sister sit six size skin sky sleep slow small smell smile snow soft soil soldier song sound south space speak speed
spring square stand star start station stay steel step stick stone stop store storm story straight strange street
strong student study sugar summer sun supply sure swim table tail talk tall teach team tell ten test thick thin thing
think third three throw tie time tiny tired today together tomorrow tool top touch town track trade train travel tree
trip truck true try turn twelve two under until valley very village visit voice wait walk wall warm wash watch water
wave wear weather week weight west wheel white whole wide wild wind window winter wire wish woman wonder wood word work
world write wrong yard year yellow young
""".split()


def random_text(rng: random.Random, n_words: int, head: str) -> str:
    return " ".join([head, *rng.choices(WORDS, k=n_words - 1)])


def make_prompts(rng: random.Random, n: int, n_words: int) -> list[str]:
    """n prompts of n_words random words, each starting with its own word + index (no shared first block)."""
    return [random_text(rng, n_words, f"{rng.choice(WORDS)}{i}") for i in range(n)]


def parse_sse_line(line: str) -> dict | str | None:
    """One SSE line: its JSON payload, DONE, or None for blanks, comments and other fields.
    An `error:` line (some llama-server versions) comes back as {"error": payload}."""
    line = line.strip()
    for prefix in ("data:", "error:"):
        if line.startswith(prefix):
            payload = line[len(prefix):].strip()
            if payload == DONE:
                return DONE
            obj = json.loads(payload)
            return obj if prefix == "data:" else {"error": obj}
    return None


@dataclass
class Result:
    sent: float
    chunk_times: list[float] = field(default_factory=list)
    usage: dict | None = None
    error: str | None = None

    @property
    def ttft(self) -> float:
        return self.chunk_times[0] - self.sent

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:])]

    @property
    def output_tokens(self) -> int:
        return (self.usage or {}).get("completion_tokens") or len(self.chunk_times)

    @property
    def cached_tokens(self) -> int | None:
        return ((self.usage or {}).get("prompt_tokens_details") or {}).get("cached_tokens")


async def send(client: httpx.AsyncClient, model: str, prompt: str, max_tokens: int,
               sampling: dict | None = None, into: Result | None = None) -> Result:
    """One streamed completion, greedy unless `sampling` (body fields: temperature, seed, ...) says;
    `into`: the Result to fill as chunks arrive (read by others while it streams)."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}, **(sampling or {})}
    r = into or Result(sent=time.perf_counter())
    try:
        async with client.stream("POST", "/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")
                r.error = f"HTTP {resp.status_code}: {text[:500]}"
                return r
            async for line in resp.aiter_lines():
                ev = parse_sse_line(line)
                if ev is None:
                    continue
                if ev == DONE:
                    break
                now = time.perf_counter()
                if "error" in ev:
                    r.error = f"error event: {json.dumps(ev['error'])[:500]}"
                    return r
                if any(c.get("text") for c in ev.get("choices") or []):
                    r.chunk_times.append(now)
                if ev.get("usage"):
                    r.usage = ev["usage"]
    except (httpx.HTTPError, ValueError) as exc:
        r.error = f"{type(exc).__name__}: {exc}"
        return r
    if not r.chunk_times:
        r.error = "the stream ended without any text"
    return r


def pct(xs: list[float], q: float) -> float | None:
    return float(np.percentile(xs, q)) if xs else None


def summarize(results: list[Result], duration: float) -> dict:
    ok = [r for r in results if r.error is None]
    out_tokens = sum(r.output_tokens for r in ok)
    ttfts = [r.ttft for r in ok]
    itls = [x for r in ok for x in r.itls]
    prompt = [r.usage["prompt_tokens"] for r in ok if r.usage and "prompt_tokens" in r.usage]
    return {"requests": len(results), "failed": len(results) - len(ok), "duration_s": duration,
            "output_tokens": out_tokens, "output_tok_s": out_tokens / duration if duration > 0 else None,
            "ttft_p50_s": pct(ttfts, 50), "ttft_p99_s": pct(ttfts, 99),
            "itl_p50_s": pct(itls, 50), "itl_p99_s": pct(itls, 99),
            "mean_prompt_tokens": statistics.mean(prompt) if prompt else None,
            "errors": sorted({r.error for r in results if r.error})[:3]}


async def run_level(client: httpx.AsyncClient, model: str, prompts: list[str], c: int, max_tokens: int,
                    temperature: float = 0.0) -> dict:
    """The prompts with at most c in flight; temperature > 0: sampled, request i with seed i."""
    sem = asyncio.Semaphore(c)

    async def one(i: int, prompt: str) -> Result:
        async with sem:
            sampling = {"temperature": temperature, "seed": i} if temperature > 0 else None
            return await send(client, model, prompt, max_tokens, sampling)
    t0 = time.perf_counter()
    results = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
    return summarize(results, time.perf_counter() - t0)


async def run_shared_prefix(client: httpx.AsyncClient, model: str, rng: random.Random, args) -> dict:
    prefix = random_text(rng, args.prefix_words, f"{rng.choice(WORDS).capitalize()}{rng.randrange(10**6)}")
    results = []
    for i in range(5):
        question = " ".join(rng.choices(WORDS, k=6))
        results.append(await send(client, model, f"{prefix}\nQuestion {i + 1}: {question}?\nAnswer:",
                                  args.prefix_max_tokens))
    ttfts = [r.ttft if r.error is None else None for r in results]
    warm = [t for t in ttfts[1:] if t is not None]
    cold, warm_med = ttfts[0], (statistics.median(warm) if warm else None)
    return {"requests": 5, "failed": sum(r.error is not None for r in results),
            "ttft_cold_s": cold, "ttft_warm_s": warm_med,
            "warm_over_cold": warm_med / cold if cold and warm_med is not None else None,
            "ttfts_s": ttfts, "cached_tokens": [r.cached_tokens for r in results],
            "prompt_tokens": [(r.usage or {}).get("prompt_tokens") for r in results],
            "errors": sorted({r.error for r in results if r.error})[:3]}


@contextlib.contextmanager
def started_server(model: str, extra: list[str]) -> Iterator[str]:
    """`tensorserve serve` on free ports; yields its base URL and stops it (SIGTERM, then kill) on exit."""
    with tempfile.TemporaryDirectory(prefix="bench-serving-") as tmp:
        ready, log = Path(tmp) / "serve.json", Path(tmp) / "serve.log"
        cmd = [sys.executable, "-m", "tensorserve", "serve", "--model", model, "--http-port", "0",
               "--grpc-port", "0", "--ready-file", str(ready), *extra]
        with open(log, "wb") as log_f:
            # its own session, so a kill after the timeout can take its children with it
            proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log_f, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            deadline, info = time.monotonic() + 900, None
            while info is None:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"tensorserve serve did not start:\n{log.read_text(errors='replace')[-3000:]}")
                with contextlib.suppress(FileNotFoundError, json.JSONDecodeError):
                    info = json.loads(ready.read_text())
                time.sleep(0.2)
            yield f"http://{info['http']}"
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(90)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()


async def bench(args, base: str) -> dict:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    conc = [int(c) for c in args.concurrency.split(",") if c]
    n_conn = max(conc, default=1) + 16
    limits = httpx.Limits(max_connections=n_conn, max_keepalive_connections=n_conn)
    async with httpx.AsyncClient(base_url=base, headers=headers, timeout=httpx.Timeout(1800.0), limits=limits) as client:
        model = args.model if args.base and args.model else None
        if model is None:
            try:
                resp = await client.get("/v1/models")
                resp.raise_for_status()
                model = resp.json()["data"][0]["id"]
            except (httpx.HTTPError, ValueError, LookupError) as exc:
                raise SystemExit(f"GET {base}/v1/models failed ({type(exc).__name__}: {exc}); pass --model")
        rng = random.Random(args.seed)
        warm = await send(client, model, make_prompts(rng, 1, 20)[0], 8)
        if warm.error:
            raise SystemExit(f"warm-up request failed: {warm.error}")
        report: dict = {"model": model}
        if "random" in args.workloads:
            for c in conc:
                print(f"random: concurrency {c}, {max(8, 2 * c)} requests ...", file=sys.stderr, flush=True)
                prompts = make_prompts(rng, max(8, 2 * c), args.prompt_words)
                report[f"c{c}"] = await run_level(client, model, prompts, c, args.max_tokens)
        if "shared_prefix" in args.workloads:
            print("shared_prefix: 5 sequential requests ...", file=sys.stderr, flush=True)
            report["shared_prefix"] = await run_shared_prefix(client, model, rng, args)
        if "long_prompt" in args.workloads:
            print(f"long_prompt: {args.long_streams} streams, then a {args.long_words}-word prompt ...",
                  file=sys.stderr, flush=True)
            report["long_prompt"] = await long_prompt.run(client, model, rng, args)
        return report


def machine() -> str:
    cpu = platform.processor()
    with contextlib.suppress(OSError):
        cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), cpu)
    return (f"{platform.system()} {platform.machine()}, {cpu or 'unknown CPU'}, {os.cpu_count()} CPUs, "
            f"Python {platform.python_version()}")


def ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:.1f}"


def print_table(r: dict) -> None:
    print(f"server {r['server']}, model {r['model']}, seed {r['seed']}, {r['machine']}")
    levels = [k for k in r if k.startswith("c") and k[1:].isdigit()]
    if levels:
        print(f"{'conc':>5} {'reqs':>5} {'fail':>5} {'dur s':>7} {'out tok/s':>10} {'TTFT p50':>9} {'TTFT p99':>9}"
              f" {'ITL p50':>8} {'ITL p99':>8} {'prompt':>7}   (latencies in ms)")
        for k in levels:
            s, tps, pt = r[k], r[k]["output_tok_s"], r[k]["mean_prompt_tokens"]
            print(f"{k[1:]:>5} {s['requests']:>5} {s['failed']:>5} {s['duration_s']:>7.1f} "
                  f"{'-' if tps is None else f'{tps:.1f}':>10} {ms(s['ttft_p50_s']):>9} {ms(s['ttft_p99_s']):>9} "
                  f"{ms(s['itl_p50_s']):>8} {ms(s['itl_p99_s']):>8} {'-' if pt is None else f'{pt:.0f}':>7}")
            for e in s["errors"]:
                print(f"      error: {e}")
    if "long_prompt" in r:
        print(long_prompt.describe(r["long_prompt"]))
    if "shared_prefix" in r:
        s = r["shared_prefix"]
        ratio = "-" if s["warm_over_cold"] is None else f"{s['warm_over_cold']:.2f}"
        print(f"shared prefix, prompt tokens {s['prompt_tokens']}: TTFT cold {ms(s['ttft_cold_s'])} ms, "
              f"warm {ms(s['ttft_warm_s'])} ms (warm/cold {ratio}), cached_tokens {s['cached_tokens']}")
        for e in s["errors"]:
            print(f"      error: {e}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", help="URL of a running OpenAI-compatible server; default: start tensorserve serve")
    ap.add_argument("--model", help=f"model name to request (and to serve, default {MODEL}); "
                                    "default with --base: the first of GET /v1/models")
    ap.add_argument("--serve-arg", action="append", default=[], help="extra argument for tensorserve serve")
    ap.add_argument("--api-key")
    ap.add_argument("--concurrency", default="1,4,16,32")
    ap.add_argument("--workloads", default="random,shared_prefix")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--prompt-words", type=int, default=127)
    ap.add_argument("--prefix-words", type=int, default=975)
    ap.add_argument("--prefix-max-tokens", type=int, default=16)
    ap.add_argument("--long-words", type=int, default=7800, help="words of long_prompt's prompt (~tokens)")
    ap.add_argument("--long-streams", type=int, default=8, help="streams decoding while it is prefilled")
    ap.add_argument("--seed", type=int, help="prompt seed; default from the clock, so prompts are fresh each run")
    ap.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    ap.add_argument("--out", help="also write the JSON here")
    args = ap.parse_args()
    args.workloads = set(args.workloads.split(","))
    if not args.workloads <= {"random", "shared_prefix", "long_prompt"}:
        ap.error("--workloads takes random, shared_prefix and/or long_prompt")
    if args.seed is None:
        args.seed = time.time_ns() % 2**32

    with contextlib.ExitStack() as stack:
        base = args.base.rstrip("/") if args.base else stack.enter_context(
            started_server(args.model or MODEL, args.serve_arg))
        report = asyncio.run(bench(args, base))
    report.update(server=args.base or "tensorserve serve (started)", seed=args.seed, command=sys.argv,
                  machine=machine())
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    if args.json:
        print(json.dumps(report))
    else:
        print_table(report)
    levels = [v for v in report.values() if isinstance(v, dict) and "failed" in v]
    if levels and all(v["failed"] == v["requests"] for v in levels):
        print("every request failed:\n" + "\n".join(sorted({e for v in levels for e in v["errors"]})), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
