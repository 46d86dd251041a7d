"""Where a single-sequence decode step goes: per thread and phase of the replayed region.

The replayed decode pass (kernels/cpu/graph_replay.py) runs every operation of a
step in one compiled region; with `Replay.cycle_log` set, each thread stamps the
time-stamp counter when an operation starts and when it reaches the meeting after
a product or attention. This script decodes a few greedy sequences in process,
as loadtest/bench_forward.py does, and prints for each thread the median cycles
of each phase converted to microseconds a step: products by matrix shape (with
the rate they streamed their codes and scales at), attention, the waits at the
meetings, the element-wise operations, the copy of the result; then the step
against the region and the Python around it.

    python loadtest/profile_decode.py [--model smollm2-135m] [--sequences 4] [--tokens 80] [--prompt 16]
"""
from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from shared.options import options_of, parse_with  # noqa: E402
from worker.config import WorkerConfig  # noqa: E402


def cycles_per_us() -> float:
    from numba import njit

    from kernels.cpu.spin_barrier import cycle_counter

    read = njit(lambda: cycle_counter())
    read()
    t, c = time.perf_counter(), read()
    time.sleep(0.2)
    return (read() - c) / (time.perf_counter() - t) / 1e6


def op_labels(program) -> tuple[list[str], dict[str, int]]:
    """A name per operation (products by their matrix's shape) and the bytes each product name reads a step."""
    from kernels.cpu import graph_capture as gc

    names = {gc.ADD: "add", gc.ATTENTION: "attention", gc.GELU_TANH_GATE: "gelu gate", gc.RMS_NORM: "rms norm",
             gc.ROPE: "rope", gc.SCALE: "scale", gc.SWIGLU: "swiglu"}
    labels, nbytes = [], defaultdict(int)
    for op in program.ops:
        if op[0] == gc.MATMUL:
            m = program.matrices[op[5]]
            label = f"product {m.out_features}x{m.in_features}"
            nbytes[label] += m.nbytes
        else:
            label = names.get(int(op[0]), f"op {int(op[0])}")
        labels.append(label)
    return labels, dict(nbytes)


def meetings(program) -> list[bool]:
    """For each operation, whether the threads meet after it (products and attention)."""
    from kernels.cpu import graph_capture as gc

    return [int(op[0]) in (gc.MATMUL, gc.ATTENTION) for op in program.ops]


def phases(stamps: np.ndarray, labels: list[str], meets: list[bool]) -> list[dict[str, float]]:
    """Per thread, cycles by phase of one step's stamps (int64 [threads, ops + 3, 2])."""
    n_ops = len(labels)
    out = []
    for th in range(stamps.shape[0]):
        s = stamps[th].astype(np.int64)
        acc: dict[str, float] = defaultdict(float)
        acc["input rows (embedding)"] += s[1, 0] - s[0, 0]
        for i, label in enumerate(labels):
            start, meet, end = s[i + 1, 0], s[i + 1, 1], s[i + 2, 0]
            if meets[i]:
                acc[label] += meet - start
                acc[f"  wait after {label}"] += end - meet
            else:
                acc[label] += end - start
        acc["result copy (and argmax)"] += s[n_ops + 2, 0] - s[n_ops + 1, 0]
        acc["region"] = s[n_ops + 2, 0] - s[0, 0]
        out.append(acc)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sequences", type=int, default=4, help="greedy sequences decoded one after another")
    ap.add_argument("--tokens", type=int, default=80, help="decode steps per sequence")
    ap.add_argument("--prompt", type=int, default=16, help="prompt tokens per sequence")
    args, options = parse_with(ap, options_of(WorkerConfig, only=("model", "model_cache")))

    from kernels.cpu import graph_replay
    from scheduler.sequence import Sequence
    from shared.sampling_params import SamplingParams
    from tensorserve.local import LocalEngine

    engine = LocalEngine(options["model"], load_tokenizer=False, max_num_batched_tokens=512, max_num_seqs=1)
    runner = engine.runner
    rng = np.random.default_rng(0)
    vocab = engine.config.vocab_size
    regions: list[float] = []
    replay_call = graph_replay._replay

    def timed_replay(*a):
        t = time.perf_counter()
        out = replay_call(*a)
        regions.append(time.perf_counter() - t)
        return out

    graph_replay._replay = timed_replay
    step_s: list[float] = []
    host_s: list[float] = []                   # each step's time outside its region call
    log: list[np.ndarray] = []
    for n in range(args.sequences + 1):        # the first sequence warms up (and captures the program)
        seq = Sequence(rng.integers(1000, vocab - 1000, args.prompt).tolist(),
                       SamplingParams(max_tokens=args.tokens + 1, temperature=0.0, ignore_eos=True))
        engine.engine.add(seq)
        while not seq.output:
            engine.engine.step()
        if n == 1:
            replays = [r for r in getattr(runner.ops, "_replays", {}).values() if r is not None and r.program.rows == 1]
            if not replays:
                print(f"{options['model']}: decode steps are not replayed on this machine (no 8-bit products, or "
                      "the program could not be captured): nothing to profile", file=sys.stderr)
                return 1
            replay = replays[0]
            replay.cycle_log = log
            regions.clear()
        while engine.engine.has_work():
            in_region = len(regions)
            t = time.perf_counter()
            engine.engine.step()
            if n > 0:
                step_s.append(time.perf_counter() - t)
                host_s.append(step_s[-1] - sum(regions[in_region:]))
    graph_replay._replay = replay_call

    program = replay.program
    labels, nbytes = op_labels(program)
    per_step = [phases(s, labels, meetings(program)) for s in log]
    rate = cycles_per_us()
    n_threads = len(per_step[0])
    print(f"{options['model']}: {len(log)} decode steps of {args.sequences} sequences ({args.prompt}-token prompts), "
          f"{n_threads} threads, time-stamp counter {rate / 1e3:.2f} GHz")
    step_us, region_us, host_us = np.median(step_s) * 1e6, np.median(regions) * 1e6, np.median(host_s) * 1e6
    print(f"step {step_us:.0f} us: region call {region_us:.0f} us, Python around it {host_us:.0f} us "
          f"(medians; the Python's quartiles {np.percentile(host_s, 25) * 1e6:.0f}-{np.percentile(host_s, 75) * 1e6:.0f} us)")
    for th in range(n_threads):
        keys = list(per_step[0][th].keys())
        medians = {k: float(np.median([p[th][k] for p in per_step])) / rate for k in keys}
        region = medians.pop("region")
        products = sum(us for k, us in medians.items() if k in nbytes)
        print(f"thread {th}: region {region:.0f} us: products {products:.0f} us "
              f"({sum(nbytes.values()) / products / 1e3:.1f} GB/s over all), the rest {region - products:.0f} us")
        for k, us in sorted(medians.items(), key=lambda kv: -kv[1]):
            count = labels.count(k.strip().replace("wait after ", ""))
            times = f"({count} a step)" if count else ""
            extra = f"  {nbytes[k] / us / 1e3:5.1f} GB/s" if k in nbytes and us > 0 else ""
            print(f"  {k:32s} {us:8.1f} us  {100 * us / region:5.1f} %  {times}{extra}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
