"""Text-diffusion throughput in process: one request alone, then `--concurrency` requests batched
into shared forwards (issue #30: 8 concurrent >= 3x the tokens/s of one), and one request against
llama.cpp's `llama-diffusion-cli` on the same GGUF and settings (>= 1.0x).

Each request denoises a canvas of --gen-length tokens after its prompt with llama.cpp's block
schedule (--steps-per-block, --block-length, --algorithm, --top-k, as `tensorserve diffuse`); the
prompts are rendered as llama-diffusion-cli renders them (the model's chat template, ChatML where it
has none) and tokenized with special tokens, and the canvas is padded so prompt + canvas is a
multiple of the block length (llama.cpp's -ub). The one-request level runs `--concurrency`
requests (different prompts and seeds) one at a time, each alone in the batcher; the concurrent
level runs the same requests side by side. tokens/s is their generated tokens over the level's
wall time; steps/s a request's own steps (forwards that carried its canvas) over the time it ran
(one request: all their steps over the level's time). Rounds alternate the levels (and the peer);
figures are medians of the rounds, and every request's output must be the same alone and batched.

The peer: `--llama-diffusion-cli PATH` (or $LLAMA_DIFFUSION_CLI; else the default build of
loadtest/build_llama_diffusion_cli.sh where it exists), one process per request of the one-request
level, in turn, with its prompt text, -ub = the canvas, the same steps, block length and algorithm, --top-k, --temp 0 --top-p 1, 2 threads; its
own "total time" (the diffusion loop, model load excluded) gives its steps/s and tokens/s (steps:
the schedule's steps that commit, as ours are counted; a block whose masks run out before its
steps do ends there on both sides, llama.cpp after one more forward). At
--top-k 1 both sides commit argmax tokens and the outputs must agree token for token (checked,
`outputs_match`); at --top-k 0 llama.cpp's chain at temperature 0 still samples its `dist` from the
softmax while ours takes the argmax, so only the timings compare (the same work a position: one
softmax over the vocabulary). Without the peer the comparison is skipped with a message.

    python loadtest/bench_diffusion.py [--model tests/fixtures/diffusion/tiny-llada.gguf]
        [--gen-length 64] [--steps-per-block 8] [--block-length 16] [--algorithm confidence] [--top-k 0]
        [--concurrency 8] [--rounds 3] [--threads 2] [--llama-diffusion-cli PATH] [--json]
        [--width 512 --layers 8]     # a wider random LLaDA with the fixture's tokenizer instead
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_serving import machine  # noqa: E402

MODEL = ROOT / "tests" / "fixtures" / "diffusion" / "tiny-llada.gguf"
PEER_DEFAULT = Path("/work/peer-diffusion/build/bin/llama-diffusion-cli")
PROMPTS = ["The capital of France is", "Write a poem about the sea", "Once upon a time",
           "def add(a, b):", "The three laws of motion are", "A recipe for bread:",
           "The history of the printing press", "Dear diary, today"]
# llama.cpp's DIFFUSION_ALGORITHM_* numbers (examples/diffusion/diffusion.h)
PEER_ALGORITHMS = {"origin": 0, "entropy": 1, "margin": 2, "random": 3, "confidence": 4}
PEER_TIME = re.compile(r"total time:\s*([0-9.]+)\s*ms, time per step:\s*([0-9.]+)\s*ms")


def write_wider_llada(src: Path, dst: Path, width: int, layers: int) -> Path:
    """A random LLaDA GGUF with the fixture's tokenizer and metadata but `layers` blocks of `width`
    (heads of 64, feed-forward 3x width, f32, tied output), so that the layers' products weigh as
    in a real model next to the vocabulary's head; written once (kept by name)."""
    import numpy as np
    from gguf import GGUFReader, GGUFValueType, GGUFWriter

    if dst.exists():
        return dst
    reader = GGUFReader(str(src))
    ff, heads = 3 * width, width // 64
    dims = {"embedding_length": width, "block_count": layers, "feed_forward_length": ff,
            "attention.head_count": heads, "attention.head_count_kv": heads, "rope.dimension_count": 64}
    vocab = int(reader.fields["llada.vocab_size"].contents())
    tmp = dst.with_suffix(".tmp")
    w = GGUFWriter(str(tmp), "llada")
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        name = key.split(".", 1)[1] if key.startswith("llada.") else None
        value = dims.get(name, field.contents()) if name else field.contents()
        kind = field.types[0]
        if kind == GGUFValueType.ARRAY:
            w.add_array(key, value) if field.types[1] == GGUFValueType.STRING else w.add_key_value(
                key, value, kind, sub_type=field.types[1])
        else:
            w.add_key_value(key, value, kind)
    rng = np.random.default_rng(0)

    def mat(out, inp):
        return (rng.standard_normal((out, inp), dtype=np.float32) / np.float32(np.sqrt(inp))).astype(np.float32)
    w.add_tensor("token_embd.weight", mat(vocab, width))
    w.add_tensor("output_norm.weight", np.ones(width, np.float32))
    for i in range(layers):
        for name, shape in (("attn_q", (width, width)), ("attn_k", (width, width)), ("attn_v", (width, width)),
                            ("attn_output", (width, width)), ("ffn_gate", (ff, width)), ("ffn_up", (ff, width)),
                            ("ffn_down", (width, ff))):
            w.add_tensor(f"blk.{i}.{name}.weight", mat(*shape))
        for name in ("attn_norm", "ffn_norm"):
            w.add_tensor(f"blk.{i}.{name}.weight", np.ones(width, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    tmp.rename(dst)
    return dst


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
            "steps_per_request": steps, "steps_s": statistics.mean(steps) / wall,
            "outputs": [list(r.output) for r in requests]}


def peer_path(arg: str | None) -> Path | None:
    for candidate in (arg, os.environ.get("LLAMA_DIFFUSION_CLI")):
        if candidate:
            return Path(candidate)
    return PEER_DEFAULT if PEER_DEFAULT.exists() else None


def run_peer(cli: Path, model: str, text: str, ubatch: int, steps: int, args) -> dict:
    """One llama-diffusion-cli run: its reported diffusion time and its output text."""
    cmd = [str(cli), "-m", model, "-p", text, "-ub", str(ubatch), "-b", str(max(ubatch, 2048)),
           "-c", str(max(ubatch, 4096)), "--diffusion-steps", str(steps),
           "--diffusion-block-length", str(args.block_length),
           "--diffusion-algorithm", str(PEER_ALGORITHMS[args.algorithm]), "--top-k", str(args.top_k),
           "--top-p", "1.0", "--temp", "0", "-s", "0", "-t", str(args.threads), "-tb", str(args.threads),
           "--no-log-prefix", "--no-log-timestamps"]
    t0 = time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, timeout=600)      # bytes: no newline translation
    process_s = time.perf_counter() - t0
    log = (out.stderr + out.stdout).decode("utf-8", "replace")       # llama.cpp's LOG_INF goes to stderr
    m = PEER_TIME.search(log)
    if out.returncode != 0 or m is None:
        raise RuntimeError(f"{cli.name} failed ({out.returncode}): {log[-2000:]}")
    # after the timing line: LOG_INF("\n%s\n", the generated text)
    rest = log[log.index("\n", m.end()) + 1:] if "\n" in log[m.end():] else ""
    text = rest[1:] if rest.startswith("\n") else rest
    text = text[:-1] if text.endswith("\n") else text
    return {"total_ms": float(m.group(1)), "ms_per_step": float(m.group(2)), "process_s": process_s,
            "output_text": text}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=str(MODEL))
    p.add_argument("--gen-length", type=int, default=64)
    p.add_argument("--steps-per-block", type=int, default=8,
                   help="denoising steps per block (--steps = blocks x this, as llama.cpp's schedule needs)")
    p.add_argument("--block-length", type=int, default=16)
    p.add_argument("--algorithm", default="confidence", choices=sorted(PEER_ALGORITHMS) + ["low_confidence",
                                                                                          "entropy_bound"])
    p.add_argument("--top-k", type=int, default=0, help="0: the softmax of the whole vocabulary a position; "
                   "1: argmax tokens, both sides commit the same tokens (checked)")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2, help="the peer's -t/-tb (ours: the process's cores)")
    p.add_argument("--llama-diffusion-cli", default=None,
                   help="llama.cpp's llama-diffusion-cli (default: $LLAMA_DIFFUSION_CLI, else "
                        f"{PEER_DEFAULT} where it exists); skipped when absent")
    p.add_argument("--width", type=int, default=0,
                   help="instead of --model, a random LLaDA of this width (heads of 64, FFN 3x) with the "
                        "fixture's tokenizer, written to --wide-dir: the layers then weigh as in a real model")
    p.add_argument("--layers", type=int, default=8, help="its blocks (with --width)")
    p.add_argument("--wide-dir", default="/tmp", help="where --width's GGUF is written (kept for later runs)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    if args.width:
        args.model = str(write_wider_llada(Path(args.model), Path(args.wide_dir) /
                                           f"llada-w{args.width}-l{args.layers}.gguf", args.width, args.layers))

    from router.chat_template import ChatTemplate, ChatTemplateMissing
    from shared.diffusion_params import DiffusionParams
    from tensorserve.local import LocalEngine

    engine = LocalEngine(args.model, max_num_seqs=max(16, args.concurrency))
    tok = engine.tokenizer
    try:          # as llama-diffusion-cli renders its prompt (tensorserve diffuse --chat)
        template = ChatTemplate.from_metadata(engine.runner.gguf.metadata, tok)
    except ChatTemplateMissing:
        template = ChatTemplate.chatml(tok)
    texts = (PROMPTS * (args.concurrency // len(PROMPTS) + 1))[:args.concurrency]
    prompts = [tok.encode(template.render([{"role": "user", "content": t}], add_generation_prompt=True),
                          add_special=True, parse_special=True) for t in texts]

    def layout(i: int) -> tuple[int, int]:
        # llama.cpp's layout: prompt + generated tokens a multiple of the block length
        gen = args.gen_length + (-(len(prompts[i]) + args.gen_length)) % args.block_length
        return gen, (len(prompts[i]) + gen) // args.block_length * args.steps_per_block

    def params_of(i: int) -> DiffusionParams:
        gen, steps = layout(i)
        params = DiffusionParams(gen_length=gen, steps=steps, block_length=args.block_length,
                                 algorithm=args.algorithm, top_k=args.top_k, seed=i)
        params.validate(len(prompts[i]))
        return params

    cli = peer_path(args.llama_diffusion_cli)
    peer_note = None
    if cli is None:
        peer_note = ("llama-diffusion-cli not given (--llama-diffusion-cli, $LLAMA_DIFFUSION_CLI; "
                     "loadtest/build_llama_diffusion_cli.sh builds it): peer comparison skipped")
    elif not cli.exists():
        peer_note, cli = f"{cli} does not exist: peer comparison skipped", None
    if peer_note and not args.json:
        print(peer_note, file=sys.stderr)

    run_level(engine, prompts[:1], params_of)            # warm-up: compiles and first-touch
    one, many, peer = [], [], []
    for _ in range(args.rounds):
        # one request at a time: each prompt alone in turn (the same requests as the concurrent level)
        alone = [run_level(engine, [prompt], lambda _i, i=i: params_of(i)) for i, prompt in enumerate(prompts)]
        wall = sum(r["wall_s"] for r in alone)
        one.append({"wall_s": wall, "tok_s": sum(r["tokens"] for r in alone) / wall,
                    "steps_s": sum(r["steps_per_request"][0] for r in alone) / wall,
                    "steps": [r["steps_per_request"][0] for r in alone],
                    "outputs": [r["outputs"][0] for r in alone]})
        if cli is not None:
            runs = [run_peer(cli, args.model, texts[i], len(prompts[i]) + layout(i)[0], layout(i)[1], args)
                    for i in range(len(prompts))]
            peer.append({"total_s": sum(r["total_ms"] for r in runs) / 1e3,
                         "outputs": [r["output_text"] for r in runs]})
        many.append(run_level(engine, prompts, params_of))
    single = statistics.median(r["tok_s"] for r in one)
    batched = statistics.median(r["tok_s"] for r in many)
    tokens = sum(layout(i)[0] for i in range(len(prompts)))
    steps_taken = sum(one[0]["steps"])
    report = {"machine": machine(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "command": " ".join(sys.argv), "model": Path(args.model).name,
              "settings": {**{k: getattr(args, k) for k in ("gen_length", "steps_per_block", "block_length",
                                                            "algorithm", "top_k")},
                           "requests": len(prompts), "prompt_tokens": [len(p) for p in prompts],
                           "canvas_tokens": [layout(i)[0] for i in range(len(prompts))],
                           "steps": [layout(i)[1] for i in range(len(prompts))], "steps_taken": one[0]["steps"]},
              "one": {"tok_s": single, "steps_s": statistics.median(r["steps_s"] for r in one),
                      "rounds_tok_s": [r["tok_s"] for r in one]},
              "concurrent": {"requests": args.concurrency, "tok_s": batched,
                             "rounds_tok_s": [r["tok_s"] for r in many]},
              "x_one": batched / single,
              "x_one_rounds": [m["tok_s"] / o["tok_s"] for o, m in zip(one, many)]}
    # every request's output is the same alone and batched (the worker's rows are row-invariant)
    solo = one[0]["outputs"]
    report["concurrent"]["outputs_match_alone"] = all(r["outputs"] == solo for r in many + one)
    if peer:
        total_s = statistics.median(r["total_s"] for r in peer)
        # steps: the schedule's steps that commit, as ours counts them (llama.cpp also runs one
        # forward more in a block whose masks ran out before its steps did, then leaves it)
        report["peer"] = {"cli": str(cli), "threads": args.threads, "tok_s": tokens / total_s,
                          "steps_s": steps_taken / total_s, "rounds_total_s": [r["total_s"] for r in peer]}
        report["one_vs_peer"] = {"tok_s": single / report["peer"]["tok_s"],
                                 "steps_s": report["one"]["steps_s"] / report["peer"]["steps_s"],
                                 "rounds": [(sum(o["steps"]) / o["wall_s"]) / (steps_taken / r["total_s"])
                                            for o, r in zip(one, peer)]}
        ours_text = [tok.decode(o) for o in solo]
        report["peer"]["outputs_match"] = (all(r["outputs"] == ours_text for r in peer) if args.top_k == 1
                                           else None)
    else:
        report["peer"] = {"skipped": peer_note}
    if args.json:
        print(json.dumps(report))
    else:
        s = report["settings"]
        print(f"# {report['machine']} ({report['date']}), {report['model']}, {s}")
        print(f"one request:  {single:9.1f} tok/s, {report['one']['steps_s']:.1f} steps/s "
              f"({len(prompts)} requests one at a time)")
        if peer:
            pr = report["peer"]
            print(f"llama.cpp:    {pr['tok_s']:9.1f} tok/s, {pr['steps_s']:.1f} steps/s  -> ours "
                  f"{report['one_vs_peer']['tok_s']:.2f}x (target >= 1.0x)"
                  + ("" if pr["outputs_match"] is None else f", outputs match: {pr['outputs_match']}"))
        print(f"{args.concurrency} concurrent: {batched:9.1f} tok/s in all = {report['x_one']:.2f}x one "
              f"(target >= 3x), outputs as alone: {report['concurrent']['outputs_match_alone']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
