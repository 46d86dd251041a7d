"""What a long prompt arriving does to the inter-token latency of running decodes.

Eight greedy streams decode on the in-process engine (SmolLM2) while a
4000-token prompt arrives. Three runs:

  baseline   the eight streams alone;
  chunked    the long prompt arrives and is prefilled in chunks mixed with the decodes:
             at most --max-prefill-tokens-while-decoding prompt tokens a step (default
             48, the server's; 0: the whole --max-num-batched-tokens, default 256);
  unchunked  the same with a budget that takes the whole prompt in one step
             (what a server without chunked prefill does).

The inter-token latency of a stream is the time between its consecutive
tokens; p50/p99 are over all streams' gaps while the long prompt is being
prefilled (baseline: over the same number of steps).

    python loadtest/bench_chunked_prefill.py [--long 4000] [--streams 8]
        [--max-num-batched-tokens 256] [--max-prefill-tokens-while-decoding 48] [--json]
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from scheduler.config import SchedulerConfig  # noqa: E402
from shared.options import options_of, parse_with  # noqa: E402

MODEL = "smollm2-135m"


def run(local, long_prompt: list[int] | None, streams: int, budget: int, decode_tokens: int,
        prefill_while_decoding: int | None = None) -> dict:
    from scheduler.engine import Engine
    from scheduler.sequence import Sequence
    from shared.sampling_params import SamplingParams

    runner = local.runner
    cap = runner.capacity
    engine = Engine(runner.execute, cap.num_blocks, cap.block_size, cap.max_context,
                    max_num_batched_tokens=budget, fingerprint=runner.config.fingerprint,
                    enable_prefix_caching=False, max_prefill_tokens_while_decoding=prefill_while_decoding)
    params = SamplingParams(max_tokens=10_000, temperature=0.0, ignore_eos=True)
    decoders = [Sequence([1 + i, 504, 3458, 282, 253, 1345, 1298], params) for i in range(streams)]
    for s in decoders:
        engine.add(s)
    while any(not s.output for s in decoders):      # all streams past their prefill
        engine.step()
    stamps: dict[int, list[float]] = {s.seq_id: [time.perf_counter()] for s in decoders}
    long_seq = None
    if long_prompt is not None:
        long_seq = Sequence(list(long_prompt), SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
        engine.add(long_seq)
    steps = 0
    t0 = time.perf_counter()
    while (long_seq is not None and not long_seq.finish_reason) or (long_seq is None and steps < decode_tokens):
        for s in engine.step():
            if s.seq_id in stamps:
                stamps[s.seq_id].append(time.perf_counter())
        steps += 1
    elapsed = time.perf_counter() - t0
    gaps = np.concatenate([np.diff(v) for v in stamps.values()])
    for s in decoders:
        engine.abort(s.seq_id)
    return {"steps": steps, "seconds": round(elapsed, 3), "itl_p50_s": round(float(np.percentile(gaps, 50)), 4),
            "itl_p99_s": round(float(np.percentile(gaps, 99)), 4), "itl_max_s": round(float(gaps.max()), 4)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--long", type=int, default=4000, help="tokens of the arriving prompt")
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--json", action="store_true")
    args, options = parse_with(ap, options_of(SchedulerConfig, only=("max_num_batched_tokens",
                                                                      "max_prefill_tokens_while_decoding")))

    from tensorserve.local import LocalEngine
    local = LocalEngine(MODEL, kv_memory=1024 * 2**20)
    words = ("the river runs past an old mill where children play in summer and fishermen wait for "
             "evening light while the town sleeps ").split()
    text = " ".join(words[i % len(words)] + str(i % 97) for i in range(args.long))
    long_prompt = local.tokenizer.encode(text)[:args.long]
    limit = options['max_prefill_tokens_while_decoding']
    chunked = run(local, long_prompt, args.streams, options['max_num_batched_tokens'], 0, limit)
    baseline = run(local, None, args.streams, options['max_num_batched_tokens'], chunked["steps"])
    unchunked = run(local, long_prompt, args.streams, len(long_prompt) + args.streams, 0)
    out = {"model": MODEL, "long_prompt_tokens": len(long_prompt), "streams": args.streams,
           "max_num_batched_tokens": options['max_num_batched_tokens'],
           "max_prefill_tokens_while_decoding": limit,
           "baseline": baseline, "chunked": chunked, "unchunked": unchunked,
           "machine": f"{platform.system()} {platform.machine()}, {__import__('os').cpu_count()} CPUs",
           "command": sys.argv}
    if args.json:
        print(json.dumps(out))
    else:
        print(f"{args.streams} decoding streams, a {len(long_prompt)}-token prompt arriving, {MODEL}")
        print(f"{'run':<11}{'steps':>7}{'ITL p50 ms':>12}{'ITL p99 ms':>12}{'ITL max ms':>12}")
        for name in ("baseline", "chunked", "unchunked"):
            r = out[name]
            print(f"{name:<11}{r['steps']:>7}{r['itl_p50_s'] * 1e3:>12.1f}{r['itl_p99_s'] * 1e3:>12.1f}"
                  f"{r['itl_max_s'] * 1e3:>12.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
