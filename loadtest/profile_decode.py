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

    python loadtest/profile_decode.py [--model smollm2-135m] [--sequences 4] [--tokens 80] [--prompt 16 ...]
                                      [--host-alone [--evict MIB]]
"""
from __future__ import annotations

import argparse
import inspect
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


def skipping_region(replay_call):
    """A stand-in for the region call, for --host-alone: computes nothing, leaves a valid greedy
    token (id 0) and zero logits, so the engine goes on as after a real step."""
    names = list(inspect.signature(replay_call.py_func).parameters)
    at_result, at_greedy = names.index("result"), names.index("greedy")

    def skipped_region(*args):
        args[at_result][...] = 0.0
        args[at_greedy][...] = 0
    return skipped_region


def print_threads(log: list[np.ndarray], program) -> None:
    labels, nbytes = op_labels(program)
    per_step = [phases(s, labels, meetings(program)) for s in log]
    rate = cycles_per_us()
    for th in range(len(per_step[0])):
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


def us(values: list[float]) -> str:
    q1, med, q3 = np.percentile(values, [25, 50, 75]) * 1e6
    return f"{med:.0f} us ({q1:.0f}-{q3:.0f})"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sequences", type=int, default=4, help="greedy sequences decoded per prompt length")
    ap.add_argument("--tokens", type=int, default=80, help="decode steps per sequence")
    ap.add_argument("--prompt", type=int, nargs="+", default=[16],
                    help="prompt tokens per sequence; with several lengths, their sequences alternate in one "
                         "process, so the depths are compared under the same conditions")
    ap.add_argument("--host-alone", action="store_true",
                    help="after each sequence's measured steps, as many again with the region call skipped: "
                         "the host's own work a step at that depth, apart from what the region's reads of "
                         "weights and K/V leave in the caches")
    ap.add_argument("--evict", type=int, default=0, metavar="MIB",
                    help="with --host-alone: read a buffer of MIB MiB before each of those steps (outside its "
                         "time), so the host starts with caches emptied as by a region's reads")
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

    evicting = np.ones(args.evict << 17)                # MiB of float64

    def timed_steps(count: int, evict: bool = False) -> tuple[list[float], list[float]]:
        """Each step's time and its time outside the region call."""
        step_s, host_s = [], []
        for _ in range(count):
            if evict:
                evicting.sum()
            in_region = len(regions)
            t = time.perf_counter()
            engine.engine.step()
            step_s.append(time.perf_counter() - t)
            host_s.append(step_s[-1] - sum(regions[in_region:]))
        return step_s, host_s

    skipped = skipping_region(replay_call)
    graph_replay._replay = timed_replay
    measured = {n: {"step": [], "region": [], "host": [], "alone": [], "log": []} for n in args.prompt}
    steps_a_sequence = args.tokens * (2 if args.host_alone else 1)
    replays = []
    for round_ in range(args.sequences + 1):   # the first round warms up (and captures the program)
        for n in (args.prompt if round_ else args.prompt[:1]):
            seq = Sequence(rng.integers(1000, vocab - 1000, n).tolist(),
                           SamplingParams(max_tokens=steps_a_sequence + 1, temperature=0.0, ignore_eos=True))
            engine.engine.add(seq)
            while not seq.output:
                engine.engine.step()
            if round_ == 0:
                while engine.engine.has_work():
                    engine.engine.step()
                replays = [r for r in getattr(runner.ops, "_replays", {}).values()
                           if r is not None and r.program.rows == 1]
                if not replays:
                    print(f"{options['model']}: decode steps are not replayed on this machine (no 8-bit products, "
                          "or the program could not be captured): nothing to profile", file=sys.stderr)
                    return 1
                continue
            m = measured[n]
            for r in replays:
                r.cycle_log = m["log"]
            regions.clear()
            step_s, host_s = timed_steps(args.tokens)
            m["step"] += step_s
            m["host"] += host_s
            m["region"] += regions
            for r in replays:
                r.cycle_log = None
            if args.host_alone:
                graph_replay._replay = skipped
                m["alone"] += timed_steps(args.tokens, evict=args.evict > 0)[1]
                graph_replay._replay = timed_replay
            while engine.engine.has_work():
                engine.engine.step()
    graph_replay._replay = replay_call

    print(f"{options['model']}: {args.sequences} sequences of {args.tokens} measured decode steps per prompt "
          f"length, {replays[0].n_threads} threads, lengths alternating; medians (quartiles)")
    for n, m in measured.items():
        print(f"{n}-token prompts: step {us(m['step'])}: region call {us(m['region'])}, "
              f"the host around it {us(m['host'])}")
        if args.host_alone:
            after = f", after reading {args.evict} MiB" if args.evict else ""
            print(f"{n}-token prompts: the host's work alone (region skipped{after}) {us(m['alone'])}")
    if len(args.prompt) > 1:
        base = args.prompt[0]
        for n in args.prompt[1:]:
            ratios = [f"host around the region {np.median(measured[n]['host']) / np.median(measured[base]['host']):.3f}x"]
            if args.host_alone:
                ratios.append(f"host work alone {np.median(measured[n]['alone']) / np.median(measured[base]['alone']):.3f}x")
            print(f"{n} against {base} tokens: " + ", ".join(ratios))
    for n, m in measured.items():
        print(f"\n{n}-token prompts, per thread:")
        print_threads(m["log"], replays[0].program)
    return 0


if __name__ == "__main__":
    sys.exit(main())
