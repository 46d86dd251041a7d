"""bench_serving.py's long_prompt workload (issue #35 item 5): what one long prompt does to a
server, beside llama-server in the same run.

`--long-streams` (8) greedy streams with short prompts decode until each has sent a few tokens;
then one fresh prompt of `--long-words` random words (~1 token each for SmolLM2: 7800 words fill
most of its 8192-token context) is sent. Reported: its time to first token, and the gaps between
the streams' tokens while it is prefilled (from its sending to its first token), p50/p99/max,
beside the same streams' gaps before it arrived. A server that prefills the prompt in one piece
stalls every stream for the whole prefill; chunked prefill keeps them flowing. The streams are
cancelled (connections closed) once the long prompt has its first token, so a server that stops
work whose client has left frees them at once.

llama-server needs a context per slot that holds the long prompt:
    llama-server -m MODEL.gguf -t 2 -np 9 -c 73728 --port 8090
"""
from __future__ import annotations

import asyncio
import random
import time

import httpx

STREAM_PROMPT_WORDS = 32
STREAM_TOKENS = 4096         # more than the long prefill lasts: the streams are cancelled before
LONG_MAX_TOKENS = 8
WARM_CHUNKS = 3              # tokens each stream has sent before the long prompt goes


async def run(client: httpx.AsyncClient, model: str, rng: random.Random, args) -> dict:
    import bench_serving as bs
    streams = [bs.Result(sent=time.perf_counter()) for _ in range(args.long_streams)]
    prompts = bs.make_prompts(rng, len(streams), STREAM_PROMPT_WORDS)
    tasks = [asyncio.create_task(bs.send(client, model, p, STREAM_TOKENS, into=r)) for p, r in zip(prompts, streams)]
    try:
        while not all(len(r.chunk_times) >= WARM_CHUNKS or r.error or t.done() for r, t in zip(streams, tasks)):
            await asyncio.sleep(0.02)
        long_text = bs.random_text(rng, args.long_words, f"{rng.choice(bs.WORDS).capitalize()}{rng.randrange(10**6)}")
        long = await bs.send(client, model, long_text, LONG_MAX_TOKENS)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    # a cancelled stream ends with CancelledError, not an error of its own: errors are real failures
    report = {"streams": len(streams), "failed_streams": sum(r.error is not None for r in streams),
              "long_words": args.long_words, "long_error": long.error,
              "long_prompt_tokens": (long.usage or {}).get("prompt_tokens")}
    if long.error is not None:
        return report
    first = long.chunk_times[0]
    during = gaps_between(streams, long.sent, first)
    before = gaps_between(streams, 0.0, long.sent)
    report.update(ttft_s=long.ttft, itl_during_p50_s=bs.pct(during, 50), itl_during_p99_s=bs.pct(during, 99),
                  itl_during_max_s=max(during, default=None), tokens_during=len(during),
                  itl_before_p50_s=bs.pct(before, 50), itl_before_p99_s=bs.pct(before, 99))
    return report


def gaps_between(streams: list, start: float, end: float) -> list[float]:
    """Every stream's gaps between consecutive tokens whose later token came in (start, end], and
    its open gap at `end` (from its last token before it): a stream stalled for the whole window
    counts one gap as long as the stall."""
    gaps = []
    for r in streams:
        times = [t for t in r.chunk_times if t <= end]
        gaps += [b - a for a, b in zip(times, times[1:]) if b > start]
        if times:
            gaps.append(end - times[-1])
    return gaps


def describe(r: dict) -> str:
    if r.get("long_error"):
        return f"long prompt: failed: {r['long_error']}"
    ms = lambda x: "-" if x is None else f"{x * 1e3:.0f}"   # noqa: E731
    return (f"long prompt of {r['long_prompt_tokens']} tokens beside {r['streams']} streams: TTFT {r['ttft_s']:.2f} s; "
            f"stream ITL while it prefills p50 {ms(r['itl_during_p50_s'])} ms, p99 {ms(r['itl_during_p99_s'])} ms, "
            f"max {ms(r['itl_during_max_s'])} ms ({r['tokens_during']} tokens); before it p50 "
            f"{ms(r['itl_before_p50_s'])} ms, p99 {ms(r['itl_before_p99_s'])} ms")
