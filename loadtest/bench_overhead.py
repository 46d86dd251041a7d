"""What the process split costs: one greedy stream of 256 tokens through router,
scheduler and worker (gRPC, shared-memory tensors) against the same stream from
the in-process engine, SmolLM2.

Both sides time the decode only (first token to last), alternate for several
rounds and keep their best, so a noisy neighbour hurts both alike. The added
time per step is 1/three_process_tok_s - 1/inprocess_tok_s, and
overhead_fraction is that over the in-process decode step.

    python loadtest/bench_overhead.py [--tokens 256] [--rounds 3] [--json]
"""
from __future__ import annotations

import argparse
import json
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MODEL = "smollm2-135m"
PROMPT = "Once upon a time, in a small village by the sea, there lived"


def in_process_rate(engine, prompt: list[int], n: int) -> float:
    from shared.sampling_params import SamplingParams
    stamps = []
    for _ in engine.stream(prompt, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)):
        stamps.append(time.perf_counter())
    return (len(stamps) - 1) / (stamps[-1] - stamps[0])


def three_process_rate(stub, prompt: list[int], n: int) -> float:
    from protos.tensorserve.v1 import common_pb2, router_pb2
    request = router_pb2.GenerateRequest(token_ids=router_pb2.TokenIds(ids=prompt),
                                         sampling=common_pb2.SamplingParams(max_tokens=n, temperature=0.0,
                                                                            ignore_eos=True))
    stamps = []
    for event in stub.Generate(request, timeout=600):
        if event.HasField("delta"):
            stamps.extend([time.perf_counter()] * len(event.delta.token_ids))
    return (len(stamps) - 1) / (stamps[-1] - stamps[0])


def start_stack(tmp: Path) -> tuple[subprocess.Popen, dict]:
    ready = tmp / "serve.json"
    proc = subprocess.Popen([sys.executable, "-m", "tensorserve", "serve", "--model", MODEL, "--http-port", "0",
                             "--grpc-port", "0", "--ready-file", str(ready)], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while not ready.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit("tensorserve serve did not start")
        time.sleep(0.2)
    return proc, json.loads(ready.read_text())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    import grpc
    from protos.tensorserve.v1 import router_pb2_grpc
    from tensorserve.local import LocalEngine

    engine = LocalEngine(MODEL)
    prompt = engine.tokenizer.encode(PROMPT)
    with tempfile.TemporaryDirectory() as tmp:
        proc, info = start_stack(Path(tmp))
        try:
            stub = router_pb2_grpc.GenerationStub(grpc.insecure_channel(info["grpc"]))
            three_process_rate(stub, prompt, 8)          # warm-up both sides
            in_process_rate(engine, prompt, 8)
            inproc, split = [], []
            for _ in range(args.rounds):
                inproc.append(in_process_rate(engine, prompt, args.tokens))
                split.append(three_process_rate(stub, prompt, args.tokens))
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)

    best_in, best_split = max(inproc), max(split)
    step_in = 1.0 / best_in
    added = 1.0 / best_split - step_in
    # on a shared machine single rounds swing by +-15 %: the medians are the steadier comparison
    med_in, med_split = statistics.median(inproc), statistics.median(split)
    result = {"model": MODEL, "tokens": args.tokens, "rounds": args.rounds,
              "inprocess_tok_s": best_in, "three_process_tok_s": best_split,
              "added_ms_per_step": added * 1e3, "overhead_fraction": added / step_in,
              "median_inprocess_tok_s": med_in, "median_three_process_tok_s": med_split,
              "median_overhead_fraction": med_in / med_split - 1.0,
              "inprocess_runs_tok_s": inproc, "three_process_runs_tok_s": split}
    if args.json:
        print(json.dumps(result))
    else:
        print(f"{MODEL}, greedy, {args.tokens} generated tokens, best of {args.rounds} rounds")
        print(f"  in-process engine     {best_in:7.1f} tok/s  ({step_in * 1e3:.2f} ms/step)")
        print(f"  router+scheduler+worker {best_split:5.1f} tok/s  ({1e3 / best_split:.2f} ms/step)")
        print(f"  added per step        {added * 1e3:7.2f} ms  = {added / step_in:.1%} of a decode step")
        print(f"  medians: {med_in:.1f} vs {med_split:.1f} tok/s = {med_in / med_split - 1.0:.1%} of a decode step")
    return 0


if __name__ == "__main__":
    sys.exit(main())
