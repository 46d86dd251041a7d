"""KV bytes a token of one long sequence, ours beside llama.cpp's (issue #35 item 4).

Ours, in process: a prompt of --tokens random ids prefilled with the worker's pools planned from
--kv-memory and --max-num-seqs, then a few greedy tokens; the K/V the sequence holds is the blocks
its tables hold (the full layers' table; a windowed pool's table only inside the window) times
each pool's bytes a block, reported at the end and at its peak during the prefill. The peer:
`llama-bench -p N -n 0 -v` allocates a cache for exactly N tokens (only the window for Gemma 3's
sliding-window layers) and logs each buffer's size ("KV buffer size = X MiB"), which is summed.

    python loadtest/kv_footprint.py [--model gemma3-270m] [--tokens 32760] [--kv-memory 512MiB]
                                    [--max-num-seqs 16] [--llama-bench PATH]
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from shared.common_config import BatchOptions  # noqa: E402
from shared.options import options_of, parse_with  # noqa: E402
from worker.config import WorkerConfig  # noqa: E402

KV_BUFFER = re.compile(r"KV buffer size\s*=\s*([\d.]+) MiB")
DECODE_TOKENS = 4


def held_bytes(engine, seq) -> int:
    """The K/V bytes of the blocks `seq`'s tables hold, each pool at its own bytes a block."""
    from worker.kv_pool import bytes_per_block, windowed_layers

    config, capacity = engine.config, engine.runner.capacity
    codec = engine.runner.kv.codec
    windowed = len(windowed_layers(config)) if capacity.num_window_blocks else 0
    full = sum(1 for b in seq.block_table if b >= 0)
    in_window = sum(1 for b in seq.window_table if b >= 0) if windowed else 0
    return (full * bytes_per_block(config, capacity.block_size, codec, config.n_layers - windowed)
            + in_window * bytes_per_block(config, capacity.block_size, codec, windowed))


def ours(model: str, tokens: int, kv_memory: int, max_num_seqs: int) -> dict:
    from scheduler.sequence import Sequence
    from shared.sampling_params import SamplingParams
    from tensorserve.local import LocalEngine

    engine = LocalEngine(model, kv_memory=kv_memory, max_num_seqs=max_num_seqs, load_tokenizer=False)
    capacity = engine.runner.capacity
    if tokens + DECODE_TOKENS > capacity.max_context:
        raise SystemExit(f"{model}: --tokens {tokens} does not fit the context these pools give "
                         f"({capacity.max_context}); give more --kv-memory or fewer --max-num-seqs")
    rng = np.random.default_rng(0)
    seq = Sequence(rng.integers(1000, engine.config.vocab_size - 1000, tokens).tolist(),
                   SamplingParams(max_tokens=DECODE_TOKENS, temperature=0.0, ignore_eos=True))
    engine.engine.add(seq)
    peak = 0
    while len(seq.output) < DECODE_TOKENS - 1:
        engine.engine.step()
        peak = max(peak, held_bytes(engine, seq))
    held = held_bytes(engine, seq)
    return {"capacity": str(capacity), "tokens": seq.num_tokens, "bytes": held, "peak_bytes": peak,
            "bytes_per_token": held / seq.num_tokens, "peak_bytes_per_token": peak / seq.num_tokens}


def peer(llama_bench: str, gguf: Path, tokens: int) -> dict:
    out = subprocess.run([llama_bench, "-m", str(gguf), "-p", str(tokens), "-n", "0", "-t", "2", "-r", "1", "-v"],
                         capture_output=True, text=True, check=True)
    buffers = [float(m) for m in KV_BUFFER.findall(out.stdout + out.stderr)]
    if not buffers:
        raise SystemExit("llama-bench -v logged no 'KV buffer size' line: cannot read its cache's size")
    total = sum(buffers) * 2 ** 20
    return {"tokens": tokens, "buffers_mib": buffers, "bytes": total, "bytes_per_token": total / tokens}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=32760, help="prompt tokens (ours decodes a few more)")
    ap.add_argument("--llama-bench", default=os.environ.get("LLAMA_BENCH"),
                    help="the peer's llama-bench (loadtest/build_llama_bench.sh); default $LLAMA_BENCH")
    args, options = parse_with(ap, options_of(WorkerConfig, only=("model", "model_cache", "kv_memory"))
                               + options_of(BatchOptions, only=("max_num_seqs",)))
    if args.tokens < 1:
        ap.error("--tokens takes a positive number")
    from shared.model_registry import resolve_model

    mine = ours(options["model"], args.tokens, options["kv_memory"], options["max_num_seqs"])
    print(f"ours: {mine['capacity']}; {mine['tokens']} tokens hold {mine['bytes'] / 2**20:.1f} MiB, "
          f"{mine['bytes_per_token']:.0f} B a token (peak during the prefill {mine['peak_bytes'] / 2**20:.1f} MiB, "
          f"{mine['peak_bytes_per_token']:.0f} B a token)")
    if not args.llama_bench or not Path(args.llama_bench).exists():
        print("no llama-bench (--llama-bench PATH or $LLAMA_BENCH; build it with loadtest/build_llama_bench.sh): "
              "peer skipped", file=sys.stderr)
        return 0
    theirs = peer(args.llama_bench, resolve_model(options["model"]), args.tokens)
    print(f"llama.cpp: KV buffers {' + '.join(f'{b:.2f}' for b in theirs['buffers_mib'])} MiB for {args.tokens} "
          f"tokens, {theirs['bytes_per_token']:.0f} B a token")
    print(f"ours / llama.cpp: {mine['bytes_per_token'] / theirs['bytes_per_token']:.2f}x "
          f"(at our prefill's peak {mine['peak_bytes_per_token'] / theirs['bytes_per_token']:.2f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
