"""Prefix-aware routing against round-robin: a shared-system-prompt workload on N replicas.

    python loadtest/bench_routing.py                     # both policies, 2 replicas of smollm2-135m
    python loadtest/bench_routing.py --routing round-robin --json
    python loadtest/bench_routing.py --base http://127.0.0.1:8000 --model smollm2-135m   # a running server

The workload: several distinct long system prompts, many requests each, interleaved in a seeded
random order (so that round-robin cannot partition them by accident), each with a short user
question of its own; a few requests in flight at once. A request is a prefix hit when its
usage.prompt_tokens_details.cached_tokens > 0 (its scheduler reused cached KV blocks). The first
request of each system prompt cannot hit; with prefix-aware routing every later one should, with
round-robin only the ones whose replica happens to hold the prompt. Each replica's KV pool
(--kv-memory, per worker) is sized to hold about half of the system prompts' blocks, as a cache
under pressure is: one replica cannot keep them all.

Prefix checkpoints are off in the servers it starts (a checkpoint restored from the shared local
directory would count as a hit on any replica); speculative decoding is off (it changes nothing
here but the timings).
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import sys
import time
from pathlib import Path
from typing import Iterator

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_serving import started_server as serving_stack  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
WORDS = ("amber basalt cedar delta ember fjord granite harbor island juniper kelp lagoon meadow nectar "
         "orchard prairie quartz river sierra tundra upland valley willow xenon yarrow zephyr anchor beacon "
         "canyon dune estuary forest glacier heath inlet jungle knoll ledge marsh nook oasis peak ridge "
         "shoal thicket vale wharf").split()


def system_prompts(count: int, words: int, seed: int) -> list[str]:
    """`count` system prompts of about `words` words, each opening differently (no shared first block)."""
    rng = random.Random(seed)
    return [f"System {i}: " + " ".join(rng.choice(WORDS) for _ in range(words)) + "." for i in range(count)]


def workload(prompts: int, per_prompt: int, words: int, seed: int) -> list[tuple[int, str]]:
    """(system prompt index, prompt text) in a seeded random interleaving."""
    systems = system_prompts(prompts, words, seed)
    order = [p for p in range(prompts) for _ in range(per_prompt)]
    random.Random(seed + 1).shuffle(order)
    return [(p, f"{systems[p]}\nQuestion {n}: what comes next?\nAnswer:") for n, p in enumerate(order)]


async def run_workload(base: str, model: str, requests: list[tuple[int, str]], concurrency: int,
                       max_tokens: int = 2, timeout: float = 120.0) -> dict:
    """Send the requests (at most `concurrency` at once, in order) and count the prefix hits."""
    results: list[dict | None] = [None] * len(requests)
    queue: asyncio.Queue = asyncio.Queue()
    for i, item in enumerate(requests):
        queue.put_nowait((i, item))
    async with httpx.AsyncClient(base_url=base, timeout=timeout) as client:
        async def user() -> None:
            while not queue.empty():
                i, (system, prompt) = queue.get_nowait()
                t0 = time.perf_counter()
                r = await client.post("/v1/completions", json={"model": model, "prompt": prompt,
                                                               "max_tokens": max_tokens, "temperature": 0})
                r.raise_for_status()
                usage = r.json()["usage"]
                results[i] = {"system": system, "prompt_tokens": usage["prompt_tokens"],
                              "cached_tokens": usage["prompt_tokens_details"]["cached_tokens"],
                              "seconds": time.perf_counter() - t0}
        t0 = time.perf_counter()
        await asyncio.gather(*(user() for _ in range(concurrency)))
        elapsed = time.perf_counter() - t0
        metrics = (await client.get("/metrics")).text
    hits = [r for r in results if r["cached_tokens"] > 0]
    systems = len({r["system"] for r in results})
    return {"requests": len(results), "system_prompts": systems, "hits": len(hits),
            "hit_rate": len(hits) / len(results),
            "hit_rate_after_first": len(hits) / max(1, len(results) - systems),
            "cached_token_fraction": sum(r["cached_tokens"] for r in results) / sum(r["prompt_tokens"]
                                                                                    for r in results),
            "mean_prompt_tokens": sum(r["prompt_tokens"] for r in results) / len(results),
            "seconds": elapsed, "routed": routed_counts(metrics)}


def routed_counts(metrics_text: str) -> dict[str, float]:
    """tensorserve_routed_requests_total by replica and prefix=hit|miss (the router's own view)."""
    out: dict[str, float] = {}
    for line in metrics_text.splitlines():
        if line.startswith("tensorserve_routed_requests_total{"):
            labels, value = line.rsplit(" ", 1)
            fields = {k: v.strip('"') for k, v in (kv.split("=", 1) for kv in labels[labels.index("{") + 1:-1].split(","))}
            out[f"replica {fields['replica']} {fields['prefix']}"] = float(value)
    return out


@contextlib.contextmanager
def started_server(model: str, replicas: int, routing: str, kv_memory: str, extra: list[str] = ()) -> Iterator[str]:
    """`tensorserve serve --replicas N --routing R` on free ports (bench_serving's); yields its base URL."""
    with serving_stack(model, ["--replicas", str(replicas), "--routing", routing, "--kv-memory", kv_memory,
                               "--no-prefix-checkpoints", "--speculative", "off", *extra]) as base:
        yield base


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--routing", choices=("both", "prefix-aware", "round-robin"), default="both")
    p.add_argument("--kv-memory", default="16MiB", help="per worker; about half the system prompts' blocks")
    p.add_argument("--prompts", type=int, default=4, help="distinct system prompts")
    p.add_argument("--per-prompt", type=int, default=20, help="requests per system prompt")
    p.add_argument("--words", type=int, default=150, help="words per system prompt (~1.7 tokens each)")
    p.add_argument("--concurrency", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--base", help="a running server's URL (its own --routing is measured)")
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    args = p.parse_args(argv)
    requests = workload(args.prompts, args.per_prompt, args.words, args.seed)
    results = {}
    if args.base:
        results["server"] = asyncio.run(run_workload(args.base, args.model, requests, args.concurrency,
                                                     args.max_tokens))
    else:
        for routing in (("prefix-aware", "round-robin") if args.routing == "both" else (args.routing,)):
            with started_server(args.model, args.replicas, routing, args.kv_memory) as base:
                results[routing] = asyncio.run(run_workload(base, args.model, requests, args.concurrency,
                                                            args.max_tokens))
    if args.json:
        print(json.dumps({"replicas": args.replicas, "model": args.model, "kv_memory": args.kv_memory,
                          "results": results}, indent=2))
    else:
        for name, r in results.items():
            print(f"{name:>13}: {r['hits']}/{r['requests']} requests hit a cached prefix ({r['hit_rate']:.0%}; "
                  f"{r['hit_rate_after_first']:.0%} of those after each system prompt's first), "
                  f"{r['cached_token_fraction']:.0%} of prompt tokens cached, {r['seconds']:.1f} s; routed {r['routed']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
