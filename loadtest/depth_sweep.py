"""The depth sweep of `bench_forward.py --depths N ...` (issue #35): prefill and decode at growing
context depths, ours beside llama.cpp's `llama-bench` in the same invocation.

Per model and depth N (each model up to 128 tokens short of its context):
* ours, in process: a prompt of N random token ids prefilled in chunks of 512 (prefill tok/s = N over
  the time to its first token), then 64 greedy tokens one worker call each (decode tok/s at depth N);
* the peer: `llama-bench -p N -n 0` and `-n 64 -d N`, 2 threads, flash attention off and on (the
  faster counted), one repetition a round;
* rounds alternate ours and the peer; each figure is the median of --rounds (3);
* the KV bytes one decode step reads at depth N: every layer's attended positions (a windowed layer
  at most its window) in the pool's own codec, K and V; and the decode's fraction of the memory
  bound: tok/s x (weight bytes + KV bytes a step reads) / the read bandwidth measured once per model
  (bench_forward.measure_bandwidth_gbs).

`--llama-bench PATH` or `$LLAMA_BENCH` names the peer (built by loadtest/build_llama_bench.sh);
without one the peer columns are skipped with a message.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

CHUNK = 512
DECODE_TOKENS = 64
MARGIN = 128            # tokens left below a model's context


def kv_bytes_per_step(config, depth: int, codec: str) -> int:
    """K and V bytes a decode step at `depth` reads: each layer's attended positions in `codec`."""
    from kernels.cpu.kv_codecs import row_bytes
    per_position = 2 * config.n_kv_heads * row_bytes(codec, config.head_dim)
    total = 0
    for layer in range(config.n_layers):
        window = config.layer_window(layer)
        total += (min(depth, window) if window else depth) * per_position
    return total


def ours(engine, depth: int, rng: np.random.Generator) -> tuple[float, float]:
    """(prefill tok/s, decode tok/s at depth) of one sequence, in process."""
    from scheduler.sequence import Sequence
    from shared.sampling_params import SamplingParams
    vocab = engine.config.vocab_size
    seq = Sequence(rng.integers(1000, vocab - 1000, depth).tolist(),
                   SamplingParams(max_tokens=1 + DECODE_TOKENS, temperature=0.0, ignore_eos=True))
    e = engine.engine
    e.num_decode_steps = 1
    e.blocks.reset_prefix_cache()
    t = time.perf_counter()
    e.add(seq)
    while not seq.output:
        e.step()
    prefill = depth / (time.perf_counter() - t)
    t = time.perf_counter()
    while e.has_work():
        e.step()
    decode = (len(seq.output) - 1) / (time.perf_counter() - t)
    return prefill, decode


def peer(llama_bench: str, gguf: Path, depth: int, kv_codec: str) -> tuple[float, float] | None:
    """(prefill tok/s, decode tok/s at depth) of llama-bench, the faster of flash attention off/on."""
    best_p = best_d = 0.0
    for fa in ("0", "1"):
        if kv_codec != "f16" and fa == "0":      # llama.cpp quantizes V only with flash attention
            continue
        cmd = [llama_bench, "-m", str(gguf), "-t", "2", "-r", "1", "-fa", fa, "-o", "json",
               "-ctk", kv_codec, "-ctv", kv_codec, "-p", str(depth), "-n", "0"]
        p = _run(cmd)
        d = _run(cmd[:-4] + ["-p", "0", "-n", str(DECODE_TOKENS), "-d", str(depth)])
        if p is None or d is None:
            return None
        best_p, best_d = max(best_p, p), max(best_d, d)
    return best_p, best_d


def _run(cmd: list[str]) -> float | None:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        print(f"llama-bench failed ({' '.join(cmd)}): {proc.stderr.strip()[-400:]}", file=sys.stderr)
        return None
    rows = json.loads(proc.stdout)
    return float(rows[0]["avg_ts"])


def sweep(models: list[str], depths: list[int], kv_memory: int, kv_codec: str, rounds: int,
          llama_bench: str | None) -> dict:
    from shared.model_registry import resolve_model
    from tensorserve.local import LocalEngine
    if llama_bench and not Path(llama_bench).exists():
        print(f"--llama-bench {llama_bench} does not exist: peer skipped", file=sys.stderr)
        llama_bench = None
    if not llama_bench:
        print("no llama-bench (--llama-bench PATH or $LLAMA_BENCH; build it with loadtest/build_llama_bench.sh): "
              "peer columns skipped", file=sys.stderr)
    from bench_forward import measure_bandwidth_gbs, weight_bytes_per_token
    out = {}
    for name in models:
        engine = LocalEngine(name, load_tokenizer=False, kv_memory=kv_memory, max_num_batched_tokens=CHUNK,
                             max_num_seqs=1, kv_cache_dtype=kv_codec)
        weight_bytes = weight_bytes_per_token(engine.runner.model)[0]
        bandwidth = measure_bandwidth_gbs() * 1e9
        gguf = resolve_model(name)
        limit = engine.runner.capacity.max_context - MARGIN
        rng = np.random.default_rng(0)
        ours(engine, min(CHUNK, limit), rng)                      # warm-up: compiles, first touch
        rows = []
        for depth in depths:
            if depth > limit:
                print(f"{name}: depth {depth} skipped (context {limit + MARGIN} with --kv-memory "
                      f"{kv_memory >> 20} MiB, less {MARGIN})", file=sys.stderr)
                continue
            mine, theirs = [], []
            for _ in range(rounds):
                mine.append(ours(engine, depth, rng))
                if llama_bench:
                    r = peer(llama_bench, gguf, depth, kv_codec)
                    if r is not None:
                        theirs.append(r)
            row = {"depth": depth, "prefill_tok_s": statistics.median(p for p, _ in mine),
                   "decode_tok_s": statistics.median(d for _, d in mine),
                   "kv_bytes_per_step": kv_bytes_per_step(engine.config, depth, kv_codec),
                   "weight_bytes_per_step": weight_bytes, "bandwidth_gbs": bandwidth / 1e9}
            row["of_bound"] = row["decode_tok_s"] * (weight_bytes + row["kv_bytes_per_step"]) / bandwidth
            if theirs:
                row["peer_prefill_tok_s"] = statistics.median(p for p, _ in theirs)
                row["peer_decode_tok_s"] = statistics.median(d for _, d in theirs)
                row["prefill_x"] = row["prefill_tok_s"] / row["peer_prefill_tok_s"]
                row["decode_x"] = row["decode_tok_s"] / row["peer_decode_tok_s"]
            rows.append(row)
        out[name] = rows
        del engine
    return out


def print_table(results: dict) -> None:
    for name, rows in results.items():
        print(f"\n{name}")
        print(f"{'depth':>6} {'prefill tok/s':>22} {'decode tok/s':>20} {'KV MiB/step':>12} {'of bound':>9}")
        for r in rows:
            pp = f"{r['prefill_tok_s']:.0f}" + (f" / {r['peer_prefill_tok_s']:.0f} = {r['prefill_x']:.2f}x"
                                                if "prefill_x" in r else "")
            dd = f"{r['decode_tok_s']:.1f}" + (f" / {r['peer_decode_tok_s']:.1f} = {r['decode_x']:.2f}x"
                                               if "decode_x" in r else "")
            print(f"{r['depth']:>6} {pp:>22} {dd:>20} {r['kv_bytes_per_step'] / 2**20:>12.2f} {r['of_bound']:>9.2f}")


def default_llama_bench() -> str | None:
    return os.environ.get("LLAMA_BENCH")
