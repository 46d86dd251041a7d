"""Prefix-checkpoint benchmark: what a long shared system prompt costs cold, warm, and restored.

For each model (and KV codec), with a ~2000-token system prompt and short distinct questions,
greedy, streaming, TTFT measured at the first streamed token:

  cold              stack A's first request (directory + Redis stores, both empty)
  warm              stack A again, another question (the prefix is in the pool)
  second stack      stack B, started beside A with an empty directory, sharing A's Redis
  restart, dir      A stopped, started again with its directory and no Redis (an empty pool)
  restart, redis    started again with an empty directory and the Redis

Each restored row also reports cached_tokens, the restore time the scheduler measured (reading,
checking and importing; tensorserve_prefix_checkpoint_restore_seconds) and restore GB/s over the
stored bytes, and the stored bytes per token. Target (issue #28): restored TTFT <= 0.1x cold.

    python loadtest/bench_checkpoints.py [--models smollm2-135m,gemma3-270m] [--codecs f16,q8_0,q4_0]
        [--prefix-words 1950] [--json] [--out r.json]

Redis: a private `redis-server` on a free port (the binary must be on PATH), or --redis-url.
--codecs takes worker --kv-cache-dtype values ("default": none passed).
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_serving import machine, random_text, send, started_server  # noqa: E402

QUESTIONS = ["Summarize the text above in one sentence.", "Which word appears most often above?",
             "Write a title for the text above.", "List three nouns from the text above.",
             "What is the first word above?", "Translate the first line above into French."]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def private_redis(url: str | None):
    if url:
        yield url
        return
    if shutil.which("redis-server") is None:
        raise SystemExit("redis-server is not on PATH: install it or pass --redis-url")
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="bench-redis-") as tmp:
        proc = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                                 "--appendonly", "no", "--dir", tmp], stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
        try:
            import redis
            client = redis.Redis(port=port, socket_connect_timeout=0.2)
            for _ in range(100):
                with contextlib.suppress(redis.RedisError):
                    if client.ping():
                        break
                time.sleep(0.1)
            yield f"redis://127.0.0.1:{port}/0"
        finally:
            proc.kill()
            proc.wait()


def metric(base: str, name: str, **labels: str) -> float:
    text = httpx.get(f"{base}/metrics", timeout=10).text
    total = 0.0
    for line in text.splitlines():
        m = re.match(rf"^{name}(?:\{{([^}}]*)\}})? (\S+)$", line)
        if m and all(f'{k}="{v}"' in (m.group(1) or "") for k, v in labels.items()):
            total += float(m.group(2))
    return total


def ask(base: str, model: str, prompt: str) -> dict:
    async def one():
        async with httpx.AsyncClient(base_url=base, timeout=600) as client:
            return await send(client, model, prompt, max_tokens=4)
    r = asyncio.run(one())
    if r.error:
        raise SystemExit(f"request failed: {r.error}")
    usage = r.usage or {}
    return {"ttft_s": r.ttft, "prompt_tokens": usage.get("prompt_tokens"), "cached_tokens": r.cached_tokens}


def wait_saved(base: str, store: str, blocks: int, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while metric(base, "tensorserve_checkpoint_store_puts_total", store=store) < blocks:
        if time.monotonic() > deadline:
            raise SystemExit(f"the {store} store did not receive {blocks} blocks in {timeout:.0f} s")
        time.sleep(0.5)


def restored(base: str, row: dict) -> dict:
    seconds = metric(base, "tensorserve_prefix_checkpoint_restore_seconds_total")
    stored = metric(base, "tensorserve_prefix_checkpoint_restored_bytes_total")
    return {**row, "restore_s": seconds, "restored_bytes": stored,
            "restore_gb_s": stored / seconds / 1e9 if seconds else None}


def bench_model(model: str, codec: str, args, redis_url: str) -> dict:
    rng = random.Random(f"{model}-{codec}-{time.time()}")
    system = random_text(rng, args.prefix_words, f"System{rng.randrange(10**6)}:")
    prompts = iter(f"{system}\n{q}" for q in QUESTIONS)
    extra = [*args.serve_arg, *([] if codec == "default" else ["--kv-cache-dtype", codec])]
    rows: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="bench-checkpoints-") as tmp:
        dir_a, dir_b, dir_c = (Path(tmp) / name for name in ("a", "b", "c"))
        with started_server(model, [*extra, "--checkpoint-dir", str(dir_a), "--redis-url", redis_url]) as a:
            ask(a, model, "Warm-up: say hello.")
            rows["cold"] = ask(a, model, next(prompts))
            blocks = (rows["cold"]["prompt_tokens"] - 1) // 16
            rows["warm"] = ask(a, model, next(prompts))
            wait_saved(a, "directory", blocks)
            wait_saved(a, "redis", blocks)
            with started_server(model, [*extra, "--checkpoint-dir", str(dir_b), "--redis-url", redis_url]) as b:
                ask(b, model, "Warm-up: say hello.")
                rows["second stack, redis"] = restored(b, ask(b, model, next(prompts)))
        files = list(dir_a.rglob("*.tskv"))
        bytes_per_token = sum(f.stat().st_size for f in files) / (16 * len(files)) if files else None
        with started_server(model, [*extra, "--checkpoint-dir", str(dir_a)]) as a:
            ask(a, model, "Warm-up: say hello.")
            rows["restart, directory"] = restored(a, ask(a, model, next(prompts)))
        with started_server(model, [*extra, "--checkpoint-dir", str(dir_c), "--redis-url", redis_url]) as a:
            ask(a, model, "Warm-up: say hello.")
            rows["restart, redis"] = restored(a, ask(a, model, next(prompts)))
    cold = rows["cold"]["ttft_s"]
    for row in rows.values():
        row["x_cold"] = row["ttft_s"] / cold
    worst = max(rows[k]["x_cold"] for k in ("second stack, redis", "restart, directory", "restart, redis"))
    return {"model": model, "codec": codec, "stored_bytes_per_token": bytes_per_token, "rows": rows,
            "worst_restored_x_cold": worst, "target_met": worst <= 0.1}


def print_report(report: dict) -> None:
    print(f"# {report['machine']}  ({report['date']})")
    for r in report["results"]:
        print(f"\n{r['model']}, KV codec {r['codec']}: {r['stored_bytes_per_token']:.0f} stored bytes/token; "
              f"worst restored TTFT {r['worst_restored_x_cold']:.3f}x cold "
              f"({'meets' if r['target_met'] else 'misses'} the 0.1x target)")
        print(f"{'case':<22}{'TTFT ms':>10}{'x cold':>8}{'prompt':>8}{'cached':>8}{'restore ms':>12}{'GB/s':>7}")
        for name, row in r["rows"].items():
            restore = f"{row['restore_s'] * 1e3:.1f}" if "restore_s" in row else "-"
            rate = f"{row['restore_gb_s']:.2f}" if row.get("restore_gb_s") else "-"
            print(f"{name:<22}{row['ttft_s'] * 1e3:>10.1f}{row['x_cold']:>8.3f}{row['prompt_tokens']:>8}"
                  f"{row['cached_tokens'] or 0:>8}{restore:>12}{rate:>7}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="smollm2-135m,gemma3-270m", help="comma-separated models to serve")
    p.add_argument("--codecs", default="f16,q8_0,q4_0",
                   help="comma-separated worker --kv-cache-dtype values (\"default\": pass none)")
    p.add_argument("--prefix-words", type=int, default=1950, help="words in the system prompt (~1 token each)")
    p.add_argument("--redis-url", help="a Redis to use instead of a private redis-server")
    p.add_argument("--serve-arg", action="append", default=[], help="extra `tensorserve serve` argument")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--out", help="also write the JSON report here")
    args = p.parse_args()
    results = []
    with private_redis(args.redis_url) as url:
        for model in args.models.split(","):
            for codec in args.codecs.split(","):
                results.append(bench_model(model, codec, args, url))
    report = {"machine": machine(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "command": " ".join(sys.argv), "results": results,
              "median_worst_x_cold": statistics.median(r["worst_restored_x_cold"] for r in results)}
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2))
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print_report(report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
