"""Forward-pass benchmark of the in-process engine on the bundled models.

Prints, per model: prefill tok/s (one 512-token prompt, best of 3), single-sequence decode
tok/s (64 tokens after a 16-token prompt, median of 3 sequences), decode tok/s with 32
sequences in one batch (32 steps after a warm-up, best of 2), the memory-bandwidth bounds on
single-sequence decode (weight bytes one token reads, over the bandwidth measured here: in
the form the decode step reads them, i.e. the integer codes of kernels/cpu/int8_matmul.py or
quantized.py, and as float32), and peak resident memory. The host's bandwidth moves by 2x
within minutes on shared cloud machines, so each 16-step segment of the decode sequences is
paired with the bandwidth probed just before and after it (the higher of the two, by a child
process that holds the 1 GiB matrix): *of bound* is the median of these paired ratios,
*bound* the median paired bound. Beside it, for reading the host's noise only, the same
ratio with each segment's median step in place of its mean ("by median steps", JSON
decode_of_bound_steady): the probe takes the best of its gemvs, a segment's mean keeps every
pause of the host.
Each model runs in its own subprocess so
peak memory is its own. With --peer-python (a venv that has llama-cpp-python) it runs
loadtest/peer_llamacpp.py on the same GGUF files in the same run and prints the ratios.

    python loadtest/bench_forward.py [--models smollm2-135m gemma3-270m] [--json] [--decode-steps K]
                                     [--peer-python /path/to/peer-venv/bin/python]
    python loadtest/bench_forward.py --depths 512 2048 4096 7936 16384 --kv-memory 2GiB
                                     [--llama-bench PATH] [--rounds 3] [--json]    # loadtest/depth_sweep.py

Single-sequence decode is measured twice, sequences alternated: one step a worker call
(the JSON's decode_*), and --decode-steps K (8) tokens a call (multistep_decode_*): the
engine's multi-step scheduling, `tensorserve serve --num-decode-steps K`, which pays the
host's work per call (scheduling, packing, sampling, the compiled region's entry) once per K
tokens. The 32-sequence batch runs one step a call.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

PROMPT_TOKENS = 512
DECODE_TOKENS = 64
DECODE_RUNS = 3
SEGMENT = 16            # decode steps between two bandwidth probes
BATCH = 32
BATCH_STEPS = 32
BATCH_RUNS = 2


def _gemv_operands() -> tuple[np.ndarray, np.ndarray]:
    w = np.ones((16384, 16384), np.float32)
    x = np.ones((1, 16384), np.float32)
    x @ w.T                                   # pages touched once, outside the timing
    return w, x


def _best_gemv_gbs(w: np.ndarray, x: np.ndarray) -> float:
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        x @ w.T
        best = min(best, time.perf_counter() - t)
    return w.nbytes / best / 1e9


def measure_bandwidth_gbs() -> float:
    """Read bandwidth as a decode step sees it: one row times a 1 GiB float32 matrix, best of 5."""
    return _best_gemv_gbs(*_gemv_operands())


class BandwidthProbe:
    """measure_bandwidth_gbs on request in a child process that keeps the 1 GiB matrix (out of this
    process's peak RSS), so a probe between two decode segments costs ~0.2 s."""

    def __init__(self) -> None:
        # OpenBLAS's threads keep spinning after a call (until its thread timeout): the probe's took a core
        # from the decode segment that follows it (an 8-bit product right after an sgemv streamed at
        # 25 GB/s instead of 40, on the Zen 5 EPYC of docs/BENCHMARKS.md); with the smallest timeout they sleep at once
        env = {**os.environ, "OPENBLAS_THREAD_TIMEOUT": "4"}
        self.proc = subprocess.Popen([sys.executable, __file__, "--bandwidth-probe"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, env=env)
        self.proc.stdout.readline()                     # matrix allocated and read once

    def __call__(self) -> float:
        self.proc.stdin.write("\n")
        self.proc.stdin.flush()
        return float(self.proc.stdout.readline())

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait()


def serve_bandwidth_probes() -> None:
    w, x = _gemv_operands()
    print("ready", flush=True)
    for _ in sys.stdin:
        print(_best_gemv_gbs(w, x), flush=True)


def weight_bytes_per_token(model) -> tuple[int, int]:
    """Bytes a single-token decode reads (every layer matrix and vector plus the output matrix):
    in the form the one-row product reads them (integer codes where the backend keeps them), and as float32."""
    read = dense = 0
    for obj in [model.output, model.output_norm] + [v for layer in model.layers for v in vars(layer).values()]:
        if isinstance(obj, np.ndarray):
            read += obj.nbytes
            dense += obj.nbytes
        elif getattr(obj, "int8", None) is not None:      # 8-bit codes only (TS_INT8_MATMUL=1)
            dense += 4 * obj.int8.out_features * obj.int8.in_features
            read += obj.int8.nbytes
        elif hasattr(obj, "dense"):
            dense += obj.dense.nbytes
            read += obj.codes.nbytes if obj.codes is not None else obj.dense.nbytes
    return read, dense


def bench_model(name: str, decode_steps: int = 1, kv_cache_dtype: str = "f16") -> dict:
    from shared.sampling_params import SamplingParams
    from tensorserve.local import LocalEngine

    engine = LocalEngine(name, load_tokenizer=False, max_num_batched_tokens=PROMPT_TOKENS, max_num_seqs=BATCH,
                         kv_cache_dtype=kv_cache_dtype)
    vocab = engine.config.vocab_size
    rng = np.random.default_rng(0)
    greedy = lambda n: SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)  # noqa: E731

    # prefill: a 512-token prompt in one forward (and its first token)
    prefill_s = []
    for _ in range(3):
        prompt = rng.integers(1000, vocab - 1000, PROMPT_TOKENS).tolist()
        t = time.perf_counter()
        engine.generate([prompt], greedy(1))
        prefill_s.append(time.perf_counter() - t)

    # single-sequence decode: time the steps after the prefill
    def decode_rate(n_seqs: int, n_steps: int) -> float:
        from scheduler.sequence import Sequence
        seqs = [Sequence(rng.integers(1000, vocab - 1000, 16).tolist(), greedy(n_steps + 1)) for _ in range(n_seqs)]
        for s in seqs:
            engine.engine.add(s)
        while any(len(s.output) == 0 for s in seqs):      # prefill (and first token) untimed
            engine.engine.step()
        t = time.perf_counter()
        before = sum(len(s.output) for s in seqs)
        while engine.engine.has_work():
            engine.engine.step()
        return (sum(len(s.output) for s in seqs) - before) / (time.perf_counter() - t)

    # single-sequence decode: three sequences of 64 timed tokens, in segments of 16 tokens (16 steps,
    # or 16 / decode_steps calls of decode_steps tokens), each paired with the bandwidth probed just
    # before and after it (the higher of the two)
    def paired_decode(probe: BandwidthProbe, steps: int) -> tuple[float, list[tuple[float, float, float]]]:
        from scheduler.sequence import Sequence
        engine.engine.num_decode_steps = steps
        n_segments = DECODE_TOKENS // SEGMENT
        seq = Sequence(rng.integers(1000, vocab - 1000, 16).tolist(),
                       greedy(1 + n_segments * (SEGMENT + steps)))
        engine.engine.add(seq)
        while not seq.output:                             # prefill (and first token) untimed
            engine.engine.step()
        segments, timed = [], 0.0
        before = probe()
        for _ in range(n_segments):
            engine.engine.step()                          # untimed: the probe left the caches cold
            t = time.perf_counter()
            ends, start = [], len(seq.output)
            while len(seq.output) - start < SEGMENT:
                engine.engine.step()
                ends.append(time.perf_counter())
            elapsed = ends[-1] - t
            after = probe()
            # the median call: host pauses left out
            steady = (SEGMENT / len(ends)) / float(np.median(np.diff([t] + ends)))
            segments.append((SEGMENT / elapsed, max(before, after), steady))
            timed += elapsed
            before = after
        while engine.engine.has_work():
            engine.engine.step()
        engine.engine.num_decode_steps = 1
        return n_segments * SEGMENT / timed, segments

    def decode_figures(runs: list[tuple[float, list[tuple[float, float, float]]]], prefix: str) -> dict:
        segments = [seg for _, segs in runs for seg in segs]
        bandwidth = float(np.median([bw for _, bw, _ in segments]))
        return {
            f"{prefix}decode_tok_s": float(np.median([rate for rate, _ in runs])),
            f"{prefix}decode_bound_tok_s": bandwidth * 1e9 / read,
            f"{prefix}decode_bound_fp32_tok_s": bandwidth * 1e9 / dense,
            f"{prefix}decode_of_bound": float(np.median([rate * read / (bw * 1e9) for rate, bw, _ in segments])),
            # informational, not the target's figure: each segment's median step instead of its mean
            f"{prefix}decode_of_bound_steady": float(np.median([steady * read / (bw * 1e9)
                                                                for _, bw, steady in segments])),
            f"{prefix}decode_bandwidth_gbs": bandwidth,
            f"{prefix}decode_segments": [{"tok_s": rate, "bandwidth_gbs": bw, "of_bound": rate * read / (bw * 1e9),
                                          "steady_tok_s": steady} for rate, bw, steady in segments],
        }

    decode_rate(1, 4)  # warm-up

    def batch_rate() -> float:
        """32 sequences decoded together: an untimed warm-up of a few steps (a kernel compiled at first
        use once took ~2.4 s of the 5.4 s timed, on a fresh checkout), then the best of BATCH_RUNS, as the
        peer takes the best of its 2 runs."""
        decode_rate(BATCH, 2)
        return max(decode_rate(BATCH, BATCH_STEPS) for _ in range(BATCH_RUNS))
    read, dense = weight_bytes_per_token(engine.runner.model)
    probe = BandwidthProbe()
    runs: dict[int, list] = {1: [], decode_steps: []}
    try:
        for _ in range(DECODE_RUNS):       # one step a call and decode_steps a call, alternated
            for steps in sorted(runs):
                runs[steps].append(paired_decode(probe, steps))
    finally:
        probe.close()
    figures = decode_figures(runs[1], "")
    if decode_steps > 1:
        figures.update(decode_figures(runs[decode_steps], "multistep_"), multistep_decode_steps=decode_steps)
    return {
        "prefill_tok_s": PROMPT_TOKENS / min(prefill_s),
        **figures,
        "batch32_decode_tok_s": batch_rate(),
        "peak_rss_mib": peak_rss_mib(),
    }


def peak_rss_mib() -> float:
    """This process's own peak resident memory (VmHWM: unlike ru_maxrss, not inherited from a forking parent)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_peer(peer_python: str, name: str) -> dict | None:
    from shared.model_registry import resolve_model
    cmd = [peer_python, str(ROOT / "loadtest" / "peer_llamacpp.py"), "--model", str(resolve_model(name)),
           "--threads", "2", "--json"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        print(f"peer run failed for {name}: {proc.stderr.strip()[-500:]}", file=sys.stderr)
        return None
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _kv_cache_dtypes() -> tuple[str, ...]:
    """The values of the worker's --kv-cache-dtype (worker/config.py)."""
    from shared.options import options_of
    from worker.config import WorkerConfig
    return tuple(options_of(WorkerConfig, only=("kv_cache_dtype",))[0].kind.values)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["smollm2-135m", "gemma3-270m"])
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    ap.add_argument("--peer-python", default=os.environ.get("TS_PEER_PYTHON"),
                    help="python of a venv with llama-cpp-python, to run the peer side by side [env TS_PEER_PYTHON]")
    ap.add_argument("--decode-steps", type=int, default=8,
                    help="single-sequence decode is measured one step a worker call and, alternated with it, "
                         "this many (the engine's num_decode_steps, multi-step scheduling; 1: only one; "
                         "must divide 16) [default 8]")
    ap.add_argument("--kv-cache-dtype", default="f16", choices=_kv_cache_dtypes(),
                    help="the KV pool's codec, the worker's --kv-cache-dtype [default f16]")
    ap.add_argument("--depths", type=int, nargs="+",
                    help="the depth sweep (loadtest/depth_sweep.py): prefill of an N-token prompt and decode at "
                         "depth N for each N, beside llama-bench, instead of the figures above")
    ap.add_argument("--kv-memory", default="2GiB", help="KV pool of the depth sweep's engine [default 2GiB]")
    ap.add_argument("--rounds", type=int, default=3, help="depth sweep: rounds, ours and the peer's alternated")
    ap.add_argument("--llama-bench", default=os.environ.get("LLAMA_BENCH"),
                    help="llama.cpp's llama-bench for the depth sweep (loadtest/build_llama_bench.sh) [env LLAMA_BENCH]")
    ap.add_argument("--one", help=argparse.SUPPRESS)   # internal: bench one model in this process
    ap.add_argument("--bandwidth", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--bandwidth-probe", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.decode_steps < 1 or SEGMENT % args.decode_steps:
        ap.error(f"--decode-steps must divide {SEGMENT}, got {args.decode_steps}")

    if args.bandwidth_probe:
        serve_bandwidth_probes()
        return 0

    if args.depths:
        from depth_sweep import print_table, sweep
        from shared.option_kinds import parse_size
        results = {"kv_cache_dtype": args.kv_cache_dtype, "kv_memory": args.kv_memory, "rounds": args.rounds,
                   "models": sweep(args.models, args.depths, parse_size(args.kv_memory), args.kv_cache_dtype,
                                   args.rounds, args.llama_bench)}
        if args.json:
            print(json.dumps(results))
        else:
            print_table(results["models"])
        return 0

    if args.one:
        print(json.dumps(bench_model(args.one, args.decode_steps, args.kv_cache_dtype)))
        return 0
    if args.bandwidth:
        print(json.dumps(measure_bandwidth_gbs()))
        return 0

    # every measurement runs in a child of this small process, so no child inherits a large parent's RSS
    bandwidth = json.loads(subprocess.run([sys.executable, __file__, "--bandwidth"], capture_output=True,
                                          text=True, check=True).stdout)
    results: dict[str, object] = {"memory_bandwidth_gbs": bandwidth, "decode_steps": args.decode_steps,
                                  "kv_cache_dtype": args.kv_cache_dtype}
    rows = []
    for name in args.models:
        # the child's stderr passes through: a warning (a replay that fell back, say) shows in the run
        proc = subprocess.run([sys.executable, __file__, "--one", name, "--decode-steps", str(args.decode_steps),
                               "--kv-cache-dtype", args.kv_cache_dtype], stdout=subprocess.PIPE, text=True)
        if proc.returncode != 0:
            return 1
        r = json.loads(proc.stdout.strip().splitlines()[-1])
        peer = run_peer(args.peer_python, name) if args.peer_python else None
        for key, value in r.items():
            results[f"{name}.{key}"] = value
        for key, value in (peer or {}).items():
            results[f"{name}.peer_{key}"] = value
        rows.append((name, r, peer))

    if args.json:
        print(json.dumps(results, indent=None))
        return 0
    print(f"memory bandwidth (1 x 16384 @ 16384 x 16384 float32) at the start: {bandwidth:.1f} GB/s")
    head = f"{'model':<14} {'prefill tok/s':>14} {'decode tok/s':>13} {'GB/s':>6} {'bound tok/s':>12} " \
           f"{'of bound':>9} {'fp32 bound':>11} {'of fp32':>8} {'32-seq tok/s':>13} {'peak RSS MiB':>13}"
    print(head)
    for name, r, peer in rows:
        print(f"{name:<14} {r['prefill_tok_s']:>14.1f} {r['decode_tok_s']:>13.1f} {r['decode_bandwidth_gbs']:>6.1f} "
              f"{r['decode_bound_tok_s']:>12.1f} {r['decode_of_bound']:>9.2f} {r['decode_bound_fp32_tok_s']:>11.1f} "
              f"{r['decode_tok_s'] / r['decode_bound_fp32_tok_s']:>8.2f} {r['batch32_decode_tok_s']:>13.1f} "
              f"{r['peak_rss_mib']:>13.0f}")
        print_segments(r, "")
        if "multistep_decode_tok_s" in r:
            m = "multistep_"
            print(f"{'  ' + str(r[m + 'decode_steps']) + ' a call':<14} {'':>14} {r[m + 'decode_tok_s']:>13.1f} "
                  f"{r[m + 'decode_bandwidth_gbs']:>6.1f} {r[m + 'decode_bound_tok_s']:>12.1f} "
                  f"{r[m + 'decode_of_bound']:>9.2f} {r[m + 'decode_bound_fp32_tok_s']:>11.1f} "
                  f"{r[m + 'decode_tok_s'] / r[m + 'decode_bound_fp32_tok_s']:>8.2f}")
            print_segments(r, m)
        if peer:
            print(f"{'  llama.cpp':<14} {peer['prefill_tok_s']:>14.1f} {peer['decode_tok_s']:>13.1f} {'':>12} {'':>9} "
                  f"{'':>6} {'':>11} {'':>8} "
                  f"{peer.get('batch32_decode_tok_s', float('nan')):>13.1f} {peer['peak_rss_mib']:>13.0f}")
            print(f"{'  ratio':<14} {r['prefill_tok_s'] / peer['prefill_tok_s']:>14.2f} "
                  f"{r['decode_tok_s'] / peer['decode_tok_s']:>13.2f} {'':>6} {'':>12} {'':>9} {'':>11} {'':>8} "
                  f"{r['batch32_decode_tok_s'] / peer.get('batch32_decode_tok_s', float('nan')):>13.2f}")
            if "multistep_decode_tok_s" in r:
                print(f"{'  ratio, ' + str(r['multistep_decode_steps']):<14} {'':>14} "
                      f"{r['multistep_decode_tok_s'] / peer['decode_tok_s']:>13.2f}")
    return 0


def print_segments(r: dict, prefix: str) -> None:
    ratios = sorted(d["of_bound"] for d in r[prefix + "decode_segments"])
    gbs = sorted(d["bandwidth_gbs"] for d in r[prefix + "decode_segments"])
    print(f"{'  segments':<14} {len(ratios)} of {SEGMENT} tokens: of bound {ratios[0]:.2f}-{ratios[-1]:.2f} "
          f"(median {np.median(ratios):.2f}), paired bandwidth {gbs[0]:.1f}-{gbs[-1]:.1f} GB/s; "
          f"by median steps {r[prefix + 'decode_of_bound_steady']:.2f}")


if __name__ == "__main__":
    sys.exit(main())
