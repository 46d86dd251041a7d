"""Speculative decoding benchmark: what drafting buys where the output copies its input, what it
costs where it does not, and what the cost governor leaves of it under 32 concurrent streams.

One `tensorserve serve` per configuration, all started side by side and measured in turns (each
workload runs on every stack one after the other, round after round), so a host busy with
something else slows every configuration alike:

  off           --speculative off (plain decoding, launch-ahead pipelining)
  ngram         --speculative ngram with the cost governor (the default)
  ngram-nogov   --speculative ngram --no-speculative-governor (always draft), with --ungoverned
  draft         --speculative draft --draft-model PATH, with --draft-model (reported as not
                available when the server refuses it)

Workloads, greedy, streaming POST /v1/completions, ignore_eos:
  copy   single stream, one request at a time: repeat a paragraph, edit a function (rename a
         variable), quote a sentence from a document; decode tok/s = (output tokens - 1) / (last
         streamed token - first), summed over the set, so prefill is not in it
  open   single stream, open-ended continuations (a story, an explanation, a list, a letter)
  c32    32 concurrent streams: 64 requests of ~128 random words, 64 tokens each (bench_serving's
         random workload), output tok/s over the level's wall time
  c32-miss  the same level where drafts do not pay: prompts of random words from 12, so prompt
         lookup finds a draft nearly every step, sampled at temperature 1 (seed per request), so
         almost no draft is accepted; the governor's no-extra-cost path (target >= 0.97x off)
For each speculating stack and set: drafts, drafted and accepted tokens (deltas of /metrics), the
acceptance rate and mean acceptance length (tokens a verification emits), and the governor's
state per range of batch sizes at the end. Targets (issue #29): copy >= 2.0x off, open >= 0.97x
off, c32 and c32-miss >= 0.97x off.

    python loadtest/bench_speculative.py [--model smollm2-135m] [--rounds 2] [--ungoverned]
        [--draft-model PATH] [--workloads copy,open,c32,c32-miss] [--json] [--out r.json]
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_serving import WORDS, machine, make_prompts, run_level, send, started_server  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
MODEL = "smollm2-135m"

PARAGRAPH = ("The lighthouse keeper climbed the spiral stairs every evening at dusk, carrying a small brass "
             "lamp and a notebook in which he wrote the color of the sea, the direction of the wind, and "
             "the names of the ships that passed the rocks below. In winter the storms came early, and he "
             "kept the lamp burning through the night while the waves broke against the tower.")
FUNCTION = '''def moving_average(values, window):
    """The mean of each run of `window` consecutive values."""
    if window <= 0:
        raise ValueError("window must be positive")
    total = sum(values[:window])
    averages = [total / window]
    for i in range(window, len(values)):
        total += values[i] - values[i - window]
        averages.append(total / window)
    return averages
'''
DOCUMENT = ("Minutes of the harbour committee, 14 March. Present: the harbour master, the treasurer and four "
            "members. The treasurer reported that repairs to the north pier cost 12,400 pounds, which is 900 "
            "pounds over the budget agreed in January. The committee agreed to raise mooring fees by five "
            "percent from the first of May. The harbour master asked that the lighthouse lamp be replaced "
            "before the winter, and the committee agreed to ask for three quotes. The next meeting will be "
            "held on the second Tuesday of April in the harbour office.")

COPY_PROMPTS = [
    f"Repeat the paragraph exactly.\n\nParagraph: {PARAGRAPH}\n\nRepeated: {PARAGRAPH[:30]}",
    f"Rename the variable `total` to `running_sum` in this function.\n\n{FUNCTION}\nRenamed:\n\n"
    f"{FUNCTION[:60]}",
    f"Document:\n{DOCUMENT}\n\nQuote the sentences of the document about money, word for word.\n\nQuote: \""
    "The treasurer reported",
    f"Copy this text twice.\n\nText: {PARAGRAPH}\n\nFirst copy: {PARAGRAPH}\n\nSecond copy:",
]
OPEN_PROMPTS = [
    "Once upon a time, in a small village between two mountains, there lived a girl who",
    "The main reasons why the Roman Empire declined were",
    "Here is a list of ideas for a rainy weekend with children:\n1.",
    "Dear Sam,\nThank you for your letter. Since we last spoke,",
]


def metrics(base: str) -> dict[str, float]:
    """Every sample of /metrics, keyed by its line's name and labels."""
    out = {}
    for line in httpx.get(f"{base}/metrics", timeout=30).text.splitlines():
        m = re.match(r"^([a-z_:]+(?:\{[^}]*\})?) (\S+)$", line)
        if m:
            out[m.group(1)] = float(m.group(2))
    return out


SPEC = "tensorserve_spec_decode_"


def spec_delta(before: dict, after: dict) -> dict | None:
    names = {"drafts": "num_drafts_total", "draft_tokens": "num_draft_tokens_total",
             "accepted_tokens": "num_accepted_tokens_total"}
    if SPEC + names["drafts"] not in after:
        return None
    d = {k: after.get(SPEC + n, 0.0) - before.get(SPEC + n, 0.0) for k, n in names.items()}
    d["acceptance_rate"] = d["accepted_tokens"] / d["draft_tokens"] if d["draft_tokens"] else None
    d["mean_acceptance_length"] = 1 + d["accepted_tokens"] / d["drafts"] if d["drafts"] else None
    return d


def governor_states(m: dict) -> dict[str, str]:
    states = {}
    for key, value in m.items():
        g = re.match(SPEC + r'governor_state\{batch_size_range="([^"]+)",state="([a-z]+)"\}', key)
        if g and value == 1:
            states[g.group(1)] = g.group(2)
    return states


async def single_stream(base: str, model: str, prompts: list[str], max_tokens: int) -> dict:
    async with httpx.AsyncClient(base_url=base, timeout=httpx.Timeout(1800.0)) as client:
        tokens = seconds = 0.0
        per_prompt = []
        for p in prompts:
            r = await send(client, model, p, max_tokens)
            if r.error:
                raise SystemExit(f"request failed: {r.error}")
            n, dt = r.output_tokens - 1, r.chunk_times[-1] - r.chunk_times[0]
            tokens += n
            seconds += dt
            per_prompt.append(n / dt if dt > 0 else None)
    return {"decode_tok_s": tokens / seconds if seconds else None, "per_prompt_tok_s": per_prompt,
            "output_tokens": int(tokens + len(prompts))}


async def concurrent(base: str, model: str, prompts: list[str], c: int, max_tokens: int,
                     temperature: float = 0.0) -> dict:
    limits = httpx.Limits(max_connections=c + 8, max_keepalive_connections=c + 8)
    async with httpx.AsyncClient(base_url=base, timeout=httpx.Timeout(1800.0), limits=limits) as client:
        return await run_level(client, model, prompts, c, max_tokens, temperature)


def miss_prompts(rng: random.Random, n: int, n_words: int) -> list[str]:
    """n prompts of random words from a set of 12 (each prompt its own first word): every word
    recurs with many successors, so prompt lookup proposes at nearly every step and a sampled
    continuation rarely follows the proposal."""
    few = rng.sample(WORDS, 12)
    return [" ".join([f"{rng.choice(WORDS)}{i}", *rng.choices(few, k=n_words - 1)]) for i in range(n)]


def measure(base: str, model: str, workload: str, args, rng: random.Random) -> dict:
    before = metrics(base)
    if workload == "copy":
        row = asyncio.run(single_stream(base, model, COPY_PROMPTS, args.max_tokens))
    elif workload == "open":
        row = asyncio.run(single_stream(base, model, OPEN_PROMPTS, args.max_tokens))
    else:
        miss = workload == "c32-miss"
        prompts = miss_prompts(rng, 2 * args.concurrency, args.prompt_words) if miss else \
            make_prompts(rng, 2 * args.concurrency, args.prompt_words)
        level = asyncio.run(concurrent(base, model, prompts, args.concurrency, args.c32_max_tokens,
                                       1.0 if miss else 0.0))
        if level["failed"]:
            raise SystemExit(f"c{args.concurrency}: {level['failed']} requests failed: {level['errors']}")
        row = {"output_tok_s": level["output_tok_s"], "duration_s": level["duration_s"],
               "itl_p50_s": level["itl_p50_s"], "ttft_p50_s": level["ttft_p50_s"]}
    after = metrics(base)
    spec = spec_delta(before, after)
    if spec is not None:
        row["speculative"] = spec
        row["governor"] = governor_states(after)
    return row


# Every stack computes its prompts itself: with prefix checkpoints on, the stacks would share the
# default checkpoint directory, and a stack measured after another would restore the prompts that
# one computed (the same prompts each round), so the first stack alone would pay for its prefills.
PRIVATE = ["--no-prefix-checkpoints"]


def configurations(args) -> dict[str, list[str]]:
    configs = {"off": ["--speculative", "off"], "ngram": ["--speculative", "ngram"]}
    if args.ungoverned:
        configs["ngram-nogov"] = ["--speculative", "ngram", "--no-speculative-governor"]
    if args.draft_model:
        configs["draft"] = ["--speculative", "draft", "--draft-model", args.draft_model]
    return configs


def refused(model: str, flags: list[str]) -> str | None:
    """Why `serve` refuses these flags at the door (exit status 2), or None."""
    proc = subprocess.run([sys.executable, "-m", "tensorserve", "serve", "--model", model, *flags,
                           "--print-config"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    return (proc.stderr.strip() or proc.stdout.strip())[-500:] if proc.returncode else None


def ratio(a, b):
    return a / b if a and b else None


def summarize(rounds: dict[str, dict[str, list[dict]]], workloads: list[str]) -> dict:
    """Medians over the rounds, and each configuration's ratio to off."""
    out: dict = {}
    for name, per in rounds.items():
        out[name] = {}
        for w in workloads:
            rows = per.get(w, [])
            key = "output_tok_s" if w.startswith("c32") else "decode_tok_s"
            values = [r[key] for r in rows if r.get(key)]
            out[name][w] = {"tok_s": statistics.median(values) if values else None, "rounds_tok_s": values}
            specs = [r["speculative"] for r in rows if r.get("speculative")]
            if specs:
                drafts = sum(s["drafts"] for s in specs)
                drafted = sum(s["draft_tokens"] for s in specs)
                accepted = sum(s["accepted_tokens"] for s in specs)
                out[name][w].update(drafts=drafts, draft_tokens=drafted, accepted_tokens=accepted,
                                    acceptance_rate=accepted / drafted if drafted else None,
                                    mean_acceptance_length=1 + accepted / drafts if drafts else None,
                                    governor=rows[-1].get("governor"))
    for name in out:
        for w in workloads:
            out[name][w]["x_off"] = ratio(out[name][w]["tok_s"], out.get("off", {}).get(w, {}).get("tok_s"))
    return out


TARGETS = {"copy": 2.0, "open": 0.97, "c32": 0.97, "c32-miss": 0.97}


def print_report(report: dict) -> None:
    print(f"# {report['machine']}  ({report['date']}), model {report['model']}, commit {report['commit']}")
    print(f"# {report['rounds']} rounds, medians; copy/open: single-stream decode tok/s, c32: output tok/s")
    print(f"{'config':<12}{'set':<6}{'tok/s':>9}{'x off':>8}{'drafts':>8}{'accept':>8}{'mean len':>9}  governor")
    for name, per in report["summary"].items():
        for w, s in per.items():
            rate, length = s.get("acceptance_rate"), s.get("mean_acceptance_length")
            gov = " ".join(f"{k}:{v}" for k, v in (s.get("governor") or {}).items())
            print(f"{name:<12}{w:<6}{s['tok_s'] or 0:>9.1f}{s['x_off'] or 0:>8.2f}{s.get('drafts', 0):>8.0f}"
                  f"{'-' if rate is None else f'{rate:.2f}':>8}{'-' if length is None else f'{length:.2f}':>9}  {gov}")
    for name, why in report["unavailable"].items():
        print(f"{name:<12}not available: {why}")
    for w, target in TARGETS.items():
        got = report["summary"].get("ngram", {}).get(w, {}).get("x_off")
        if got is not None:
            print(f"target {w} >= {target}x off: ngram {got:.2f}x, {'met' if got >= target else 'MISSED'}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=MODEL)
    p.add_argument("--workloads", default="copy,open,c32,c32-miss")
    p.add_argument("--rounds", type=int, default=2, help="turns of every workload on every stack")
    p.add_argument("--max-tokens", type=int, default=128, help="tokens per single-stream request")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--c32-max-tokens", type=int, default=64)
    p.add_argument("--prompt-words", type=int, default=127, help="words of a concurrent request's prompt")
    p.add_argument("--ungoverned", action="store_true", help="also an ngram stack without the cost governor")
    p.add_argument("--draft-model", help="a draft GGUF for --speculative draft (passed through)")
    p.add_argument("--serve-arg", action="append", default=[], help="extra `tensorserve serve` argument, every stack")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--out", help="also write the JSON report here")
    args = p.parse_args()
    workloads = args.workloads.split(",")
    if not set(workloads) <= set(TARGETS):
        p.error(f"--workloads takes {', '.join(TARGETS)}")
    unavailable = {}
    configs = configurations(args)
    for name in list(configs):
        if name == "draft" and (why := refused(args.model, configs[name])):
            unavailable[name] = why
            del configs[name]
    rounds: dict[str, dict[str, list[dict]]] = {name: {} for name in configs}
    with contextlib.ExitStack() as stack:
        bases = {}
        for name, flags in configs.items():
            print(f"starting {name} ...", file=sys.stderr, flush=True)
            bases[name] = stack.enter_context(started_server(args.model, [*PRIVATE, *args.serve_arg, *flags]))
            asyncio.run(single_stream(bases[name], args.model, ["Warm-up: say hello."], 8))
        for i in range(args.rounds):
            for w in workloads:
                for name, base in bases.items():
                    print(f"round {i + 1}: {w} on {name} ...", file=sys.stderr, flush=True)
                    rng = random.Random(f"{args.seed}-{i}-{w}")    # the same prompts for every stack
                    rounds[name].setdefault(w, []).append(measure(base, args.model, w, args, rng))
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    report = {"machine": machine(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "commit": commit, "command": " ".join(sys.argv), "model": args.model, "rounds": args.rounds,
              "summary": summarize(rounds, workloads), "raw": rounds, "unavailable": unavailable}
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    if args.json:
        print(json.dumps(report))
    else:
        print_report(report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
