"""`make gpu-check`: everything that needs an NVIDIA GPU, in one run of well under 10 minutes.

    python loadtest/gpu_check.py [--out DIR] [--wheels DIR] [--no-install] [--models smollm2-135m gemma3-270m]

Steps, each under its own timeout, each writing its log to DIR (default $OUT, else
/tmp/tensorserve-gpu-check), and a summary in DIR/summary.json:

1. the device: nvidia-smi, and what worker/devices.py detects (devices.json);
2. the cuda extra installed into this Python's environment (pip install -e '.[cuda]'; --wheels DIR
   installs from a folder of wheels, for a machine without network; skipped where CuPy imports);
3. `pytest -m gpu`: the tests marked gpu (the CUDA kernels against the numpy backend, greedy
   decoding on CUDA equal to the CPU's: tests/test_cuda_*.py);
4. the agreement bar with llama.cpp (tests/test_agreement.py) on the CUDA backend
   (TS_TEST_BACKEND=cuda, read by tests/conftest.py's engines);
5. benchmarks on the CUDA backend, per model: 512-token prefill, single-sequence decode tok/s
   against the bound of the weight bytes a token reads over the device's peak bandwidth (from
   NVML), and 32-sequence decode (bench.json).

A step that fails or times out is recorded and the next runs. Exit status 0 when every step passed.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BUDGET_S = 540                   # the whole check, inside the device's 10-minute command limit
STEPS_S = {"nvidia-smi": 15, "devices": 30, "install": 150, "pytest-gpu": 180, "agreement": 150, "bench": 180}


def run_step(name: str, cmd: list[str], out: Path, summary: dict, deadline: float, env: dict | None = None) -> bool:
    timeout = min(STEPS_S[name], max(1.0, deadline - time.monotonic()))
    t0 = time.monotonic()
    with open(out / f"{name}.log", "w") as log:
        try:
            rc = subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, timeout=timeout,
                                env={**os.environ, **(env or {})}).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
        except OSError as exc:
            rc = f"not run: {exc}"
    summary[name] = {"rc": rc, "seconds": round(time.monotonic() - t0, 1), "log": f"{name}.log"}
    print(f"gpu-check: {name}: {rc} in {summary[name]['seconds']} s", flush=True)
    return rc == 0


def decode_bytes_per_token(gguf) -> int:
    """The weight bytes one decode token reads: every matrix, the embedding table only where it is
    also the output head (one row of it otherwise)."""
    names = set(gguf.tensors)
    return sum(t.nbytes for n, t in gguf.tensors.items() if n != "token_embd.weight" or "output.weight" not in names)


def bench_one(model: str) -> dict:
    """Prefill, single- and 32-sequence decode of `model` on the CUDA backend, in this process."""
    import numpy as np

    from shared.sampling_params import SamplingParams
    from tensorserve.local import LocalEngine
    from worker.devices import memory_bandwidth
    engine = LocalEngine(model, load_tokenizer=False, backend="cuda", max_num_batched_tokens=512, max_num_seqs=32)
    vocab = engine.config.vocab_size
    rng = np.random.default_rng(0)
    greedy = lambda n: SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)  # noqa: E731
    prompt = lambda n: rng.integers(1000, vocab - 1000, n).tolist()  # noqa: E731
    engine.generate([prompt(16)], greedy(8))               # warm-up
    prefill = []
    for _ in range(3):
        t = time.perf_counter()
        engine.generate([prompt(512)], greedy(1))
        prefill.append(time.perf_counter() - t)
    decode = []
    for _ in range(3):
        p = prompt(16)
        t = time.perf_counter()
        engine.generate([p], greedy(1))
        t1 = time.perf_counter()
        engine.generate([p], greedy(65))                   # the prompt cached: 64 decode steps more
        decode.append(64 / max(1e-9, (time.perf_counter() - t1) - (t1 - t)))
    t = time.perf_counter()
    engine.generate([prompt(16) for _ in range(32)], greedy(33))
    batch32 = 32 * 33 / (time.perf_counter() - t)
    gpu = engine.runner.placement.gpu
    bandwidth = memory_bandwidth(gpu.index)
    per_token = decode_bytes_per_token(engine.runner.gguf)
    bound = bandwidth / per_token if bandwidth else None
    single = statistics.median(decode)
    return {"model": model, "gpu": gpu.name, "prefill_512_tok_s": 512 / min(prefill), "decode_tok_s": single,
            "decode_bytes_per_token": per_token, "bandwidth_gbs": bandwidth / 1e9 if bandwidth else None,
            "decode_bound_tok_s": bound, "decode_of_bound": single / bound if bound else None,
            "batch32_decode_tok_s_incl_prefill": batch32}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT") or "/tmp/tensorserve-gpu-check")
    ap.add_argument("--wheels", help="install the cuda extra from this folder of wheels (no network)")
    ap.add_argument("--no-install", action="store_true", help="leave the environment as it is")
    ap.add_argument("--models", nargs="+", default=["smollm2-135m", "gemma3-270m"])
    ap.add_argument("--bench-one", help=argparse.SUPPRESS)       # internal: one model's benchmark as JSON
    args = ap.parse_args()
    if args.bench_one:
        print(json.dumps(bench_one(args.bench_one)))
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + BUDGET_S
    summary: dict = {"started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    py = sys.executable
    run_step("nvidia-smi", ["nvidia-smi"], out, summary, deadline)
    devices = ("from worker.devices import detect_gpus, cupy_error; import dataclasses, json; d = detect_gpus(); "
               "print(json.dumps({'gpus': [dataclasses.asdict(g) for g in d.gpus], 'reason': d.reason, "
               "'cupy': cupy_error() or 'imports'}))")
    if not args.no_install and subprocess.run([py, "-c", "import cupy, pynvml"], cwd=ROOT,
                                              capture_output=True).returncode != 0:
        source = ["--no-index", "--find-links", args.wheels] if args.wheels else []
        run_step("install", [py, "-m", "pip", "install", "-q", *source, "-e", ".[cuda]"], out, summary, deadline)
    run_step("devices", [py, "-c", devices], out, summary, deadline)
    run_step("pytest-gpu", [py, "-m", "pytest", "-q", "-m", "gpu", f"--junitxml={out / 'pytest-gpu.xml'}"],
             out, summary, deadline)
    run_step("agreement", [py, "-m", "pytest", "-q", "tests/test_agreement.py", "-k", "f16 or greedy",
                           f"--junitxml={out / 'agreement.xml'}"], out, summary, deadline, {"TS_TEST_BACKEND": "cuda"})
    bench = []
    for model in args.models:
        ok = run_step("bench", [py, __file__, "--bench-one", model], out, summary, deadline)
        lines = (out / "bench.log").read_text().strip().splitlines()
        bench.append(json.loads(lines[-1]) if ok and lines else {"model": model, "error": summary["bench"]})
        os.replace(out / "bench.log", out / f"bench-{model}.log")
    (out / "bench.json").write_text(json.dumps(bench, indent=1))
    summary["bench"] = bench
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    failed = [k for k, v in summary.items() if isinstance(v, dict) and v.get("rc") not in (0, None)]
    failed += [b["model"] for b in bench if "error" in b]
    print(f"gpu-check: results in {out}; {'failed: ' + ', '.join(failed) if failed else 'every step passed'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
