"""Text-diffusion throughput in process: one request alone, then `--concurrency` requests batched
into shared forwards (issue #30: 8 concurrent >= 3x the tokens/s of one).

Each request denoises a canvas of --gen-length tokens after its prompt with llama.cpp's block
schedule (--steps-per-block, --block-length, --algorithm, as `tensorserve diffuse`); steps/s counts the
request's own steps (forwards that carried its canvas), tokens/s its generated tokens over the
wall time. The concurrent level runs `--concurrency` requests with different prompts and seeds
side by side; its tokens/s is all of theirs over the level's wall time. Rounds alternate the two.

Not here yet: the same settings under llama.cpp's `llama-diffusion-cli` (the peer of item 8).

    python loadtest/bench_diffusion.py [--model tests/fixtures/diffusion/tiny-llada.gguf]
        [--gen-length 64] [--steps-per-block 8] [--block-length 16] [--concurrency 8] [--rounds 3] [--json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_serving import machine  # noqa: E402

MODEL = ROOT / "tests" / "fixtures" / "diffusion" / "tiny-llada.gguf"
PROMPTS = ["The capital of France is", "Write a poem about the sea", "Once upon a time",
           "def add(a, b):", "The three laws of motion are", "A recipe for bread:",
           "The history of the printing press", "Dear diary, today"]


def run_level(engine, prompts: list[list[int]], params_of) -> dict:
    """Every prompt at once in the batcher; wall time, tokens and steps per request."""
    steps = [0] * len(prompts)

    def counter(i):
        def on_step(_request):
            steps[i] += 1
        return on_step
    requests = [engine.diffusion_request(p, params_of(i), on_step=counter(i)) for i, p in enumerate(prompts)]
    t0 = time.perf_counter()
    for r in requests:
        engine.diffusion.add(r)
    while any(not r.finished for r in requests):
        engine.diffusion.step()
    wall = time.perf_counter() - t0
    tokens = sum(len(r.output) for r in requests)
    return {"requests": len(requests), "wall_s": wall, "tokens": tokens, "tok_s": tokens / wall,
            "steps_per_request": steps, "steps_s": statistics.mean(steps) / wall}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=str(MODEL))
    p.add_argument("--gen-length", type=int, default=64)
    p.add_argument("--steps-per-block", type=int, default=8,
                   help="denoising steps per block (--steps = blocks x this, as llama.cpp's schedule needs)")
    p.add_argument("--block-length", type=int, default=16)
    p.add_argument("--algorithm", default="confidence")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()

    from shared.diffusion_params import DiffusionParams
    from tensorserve.local import LocalEngine

    engine = LocalEngine(args.model, max_num_seqs=max(16, args.concurrency))
    tok = engine.tokenizer
    prompts = []
    for text in (PROMPTS * (args.concurrency // len(PROMPTS) + 1))[:args.concurrency]:
        prompts.append(tok.encode(text, add_special=True, parse_special=True))

    def params_of(i: int) -> DiffusionParams:
        # llama.cpp's layout: prompt + generated tokens a multiple of the block length
        gen = args.gen_length + (-(len(prompts[i]) + args.gen_length)) % args.block_length
        blocks = (len(prompts[i]) + gen) // args.block_length
        params = DiffusionParams(gen_length=gen, steps=blocks * args.steps_per_block, block_length=args.block_length,
                                 algorithm=args.algorithm, seed=i)
        params.validate(len(prompts[i]))
        return params

    run_level(engine, prompts[:1], params_of)            # warm-up: compiles and first-touch
    one, many = [], []
    for _ in range(args.rounds):
        one.append(run_level(engine, prompts[:1], params_of))
        many.append(run_level(engine, prompts, params_of))
    single = statistics.median(r["tok_s"] for r in one)
    batched = statistics.median(r["tok_s"] for r in many)
    report = {"machine": machine(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "command": " ".join(sys.argv), "model": Path(args.model).name,
              "settings": {k: getattr(args, k) for k in ("gen_length", "steps_per_block", "block_length", "algorithm")},
              "one": {"tok_s": single, "steps_s": statistics.median(r["steps_s"] for r in one),
                      "rounds_tok_s": [r["tok_s"] for r in one]},
              "concurrent": {"requests": args.concurrency, "tok_s": batched,
                             "rounds_tok_s": [r["tok_s"] for r in many]},
              "x_one": batched / single}
    if args.json:
        print(json.dumps(report))
    else:
        print(f"# {report['machine']} ({report['date']}), {report['model']}, {report['settings']}")
        print(f"one request:  {single:9.1f} tok/s, {report['one']['steps_s']:.1f} steps/s")
        print(f"{args.concurrency} concurrent: {batched:9.1f} tok/s in all = {report['x_one']:.2f}x one "
              f"(target >= 3x)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
