"""`tensorserve` command: a thin dispatcher over the router, scheduler and worker packages."""
from __future__ import annotations

import argparse
import importlib
import json
import sys
from pathlib import Path
from typing import Any

from router.config import RouterConfig
from scheduler.config import SPECULATIVE_OPTIONS, SchedulerConfig, check_speculative
from shared.common_config import check_model, configure
from shared.options import ArgumentParser, add_flags, options_of
from worker.config import WorkerConfig


# the in-process commands take the worker's and router's options they need, defined there
MODEL_OPTIONS = options_of(WorkerConfig, only=("model", "model_cache", "log_level"))
ENGINE_OPTIONS = options_of(WorkerConfig, only=("model", "model_cache", "log_level", "kv_memory", "kv_cache_dtype",
                                                "threads", "backend", "gpu_memory_utilization"))
DIFFUSE_OPTIONS = options_of(WorkerConfig, only=("model", "model_cache", "log_level", "threads")) \
    + options_of(RouterConfig, only=("chat_template",))
GENERATE_OPTIONS = ENGINE_OPTIONS + options_of(RouterConfig, only=("chat_template",)) \
    + options_of(SchedulerConfig, only=SPECULATIVE_OPTIONS) + options_of(WorkerConfig, only=("draft_model",))


def _placement(opts: dict) -> dict:
    return {"backend": opts["backend"], "gpu_memory_utilization": opts["gpu_memory_utilization"]}


def _check(resolved) -> None:
    gguf = check_model(resolved)
    if "backend" in resolved.values:
        from worker.config import choose_placement
        choose_placement(resolved)
    if "speculative" in resolved.values:
        check_speculative(resolved)
    if "draft_model" in resolved.values:
        from worker.config import check_draft_model
        check_draft_model(resolved, gguf)


def _configured(args: argparse.Namespace, options: list) -> Any:
    """The command's options (flag > TS_* variable > --config > default), or its exit status."""
    configured = configure(args.command, None, args, check=_check, options=options, announce=False)
    return configured if isinstance(configured, int) else configured[1].values


def cmd_models(args: argparse.Namespace) -> int:
    from shared.model_registry import BUNDLED, cache_dir
    print(f"{'name':<16} {'package':<28} description")
    for m in BUNDLED.values():
        print(f"{m.name:<16} {m.package:<28} {m.description}")
    print(f"\nAny path to a GGUF file works wherever a model is taken. Assembled models are cached in {cache_dir()}.")
    return 0


def _load_tokenizer(model: str):
    from router.tokenizer import Tokenizer
    from shared.gguf_file import GGUFFile
    from shared.model_registry import resolve_model
    gguf = GGUFFile(resolve_model(model))
    return Tokenizer.from_metadata(gguf.metadata), gguf


def cmd_tokenize(args: argparse.Namespace) -> int:
    opts = _configured(args, MODEL_OPTIONS)
    if isinstance(opts, int):
        return opts
    tokenizer, _ = _load_tokenizer(opts["model"])
    text = sys.stdin.read()
    print(json.dumps(tokenizer.encode(text, add_special=args.add_special, parse_special=args.parse_special)))
    return 0


def cmd_score(args: argparse.Namespace) -> int:
    opts = _configured(args, ENGINE_OPTIONS)
    if isinstance(opts, int):
        return opts
    from tensorserve.local import LocalEngine
    tokens = json.loads(Path(args.tokens_json).read_text())
    if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
        raise SystemExit(f"{args.tokens_json}: expected a JSON list of token ids")
    engine = LocalEngine(opts["model"], kv_memory=opts["kv_memory"], kv_cache_dtype=opts["kv_cache_dtype"],
                         load_tokenizer=False, **_placement(opts))
    vocab = engine.config.vocab_size
    bad = [t for t in tokens if not 0 <= t < vocab]
    if bad:
        raise SystemExit(f"{args.tokens_json}: token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
    json.dump(engine.score(tokens, args.top_k), sys.stdout)
    print()
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    opts = _configured(args, GENERATE_OPTIONS)
    if isinstance(opts, int):
        return opts
    if _is_diffusion_model(opts["model"]):
        raise ValueError(f"--model {opts['model']} is a text-diffusion model: generate with `tensorserve diffuse` "
                         "(--gen-length, --steps, --block-length, --algorithm)")
    from router.chat_template import ChatTemplate
    from router.detokenizer import IncrementalDetokenizer
    from shared.sampling_params import SamplingParams
    from tensorserve.local import LocalEngine

    engine = LocalEngine(opts["model"], kv_memory=opts["kv_memory"], kv_cache_dtype=opts["kv_cache_dtype"],
                         draft_model=opts["draft_model"], **{name: opts[name] for name in SPECULATIVE_OPTIONS},
                         **_placement(opts))
    tokenizer = engine.tokenizer
    if args.chat:
        template = (ChatTemplate.from_file(opts["chat_template"], tokenizer) if opts["chat_template"]
                    else ChatTemplate.from_metadata(engine.runner.gguf.metadata, tokenizer))
        text = template.render([{"role": "user", "content": args.prompt}], add_generation_prompt=True)
        prompt = tokenizer.encode(text, add_special=False, parse_special=True)
    else:
        prompt = tokenizer.encode(args.prompt, add_special=True, parse_special=False)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed)
    try:
        params.validate()
    except ValueError as exc:
        raise SystemExit(f"error: {exc}") from None
    detok = IncrementalDetokenizer(tokenizer)
    for token in engine.stream(prompt, params):
        sys.stdout.write(detok.feed(token))
        sys.stdout.flush()
    sys.stdout.write(detok.flush() + "\n")
    return 0


def _is_diffusion_model(model: str) -> bool:
    from shared.gguf_file import GGUFFile
    from shared.model_config import ModelConfig
    from shared.model_registry import resolve_model
    return not ModelConfig.from_gguf(GGUFFile(resolve_model(model))).causal


def cmd_diffuse(args: argparse.Namespace) -> int:
    opts = _configured(args, DIFFUSE_OPTIONS)
    if isinstance(opts, int):
        return opts
    from router.chat_template import ChatTemplate, ChatTemplateMissing
    from shared.diffusion_params import DiffusionParams, diffusion_flags
    from tensorserve.local import LocalEngine

    params = DiffusionParams(**{name: getattr(args, name) for _, name, _, _, _ in diffusion_flags()})
    params.validate()
    if not _is_diffusion_model(opts["model"]):
        raise ValueError(f"--model {opts['model']} is not a text-diffusion model (llada, dream): "
                         "use `tensorserve generate` for it")
    engine = LocalEngine(opts["model"])
    tokenizer = engine.tokenizer
    text = args.prompt
    if args.chat:     # the model's template, else llama.cpp's ChatML fallback, as llama-diffusion-cli
        try:
            template = (ChatTemplate.from_file(opts["chat_template"], tokenizer) if opts["chat_template"]
                        else ChatTemplate.from_metadata(engine.runner.gguf.metadata, tokenizer))
        except ChatTemplateMissing:
            template = ChatTemplate.chatml(tokenizer)
        text = template.render([{"role": "user", "content": args.prompt}], add_generation_prompt=True)
    # llama-diffusion-cli's common_tokenize(..., add_special=true, parse_special=true), chat or not
    prompt = tokenizer.encode(text, add_special=True, parse_special=True)
    output = engine.diffuse([prompt], params)[0]
    print(tokenizer.decode(output))
    return 0


def cmd_make_draft(args: argparse.Namespace) -> int:
    opts = _configured(args, MODEL_OPTIONS)
    if isinstance(opts, int):
        return opts
    from shared.model_registry import resolve_model
    from tensorserve.make_draft import make_draft
    out = make_draft(resolve_model(opts["model"]), args.layers, args.out)
    print(f"wrote {out}: the first {args.layers} layers of {opts['model']}, its output norm and head "
          f"({out.stat().st_size / 2**20:.1f} MiB); use it with --speculative draft --draft-model {out}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(prog="tensorserve", description="Serve GGUF language models.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("models", help="list the bundled models")
    p.set_defaults(func=cmd_models)

    p = sub.add_parser("generate", help="generate text in-process, streamed to stdout")
    add_flags(p, GENERATE_OPTIONS)
    p.add_argument("--prompt", "-p", required=True, help="prompt text")
    p.add_argument("--chat", action="store_true", help="wrap the prompt as a user message in the model's chat template")
    p.add_argument("--max-tokens", type=int, default=128, help="tokens to generate at most (default 128)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default 0)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default 1)")
    p.add_argument("--top-k", type=int, default=0, help="sample from the k best tokens, 0 = off (default 0)")
    p.add_argument("--seed", type=int, default=None, help="seed for reproducible sampling")
    p.set_defaults(func=cmd_generate)

    from shared.diffusion_params import diffusion_flags
    p = sub.add_parser("diffuse", help="generate text with a text-diffusion model (llada, dream) in-process, "
                       "as llama-diffusion-cli's block schedule does")
    add_flags(p, DIFFUSE_OPTIONS)
    p.add_argument("--prompt", "-p", required=True, help="prompt text")
    p.add_argument("--chat", action="store_true", help="wrap the prompt as a user message in the model's chat "
                   "template (ChatML where it has none, as llama.cpp)")
    for flag, name, kind, default, text in diffusion_flags():
        p.add_argument(flag, dest=name, type=kind, default=default, help=f"{text} (default {default})")
    p.set_defaults(func=cmd_diffuse)

    p = sub.add_parser("make-draft", help="write a self-speculative draft GGUF: a model's first N layers, its "
                       "output norm and head (for --speculative draft --draft-model FILE)")
    add_flags(p, MODEL_OPTIONS)
    p.add_argument("--layers", type=int, required=True, help="layers of the model the draft keeps (from the first)")
    p.add_argument("--out", required=True, help="the GGUF file to write")
    p.set_defaults(func=cmd_make_draft)

    p = sub.add_parser("tokenize", help="read text on stdin, print its token ids as a JSON list")
    add_flags(p, MODEL_OPTIONS)
    p.add_argument("--parse-special", action="store_true", help="turn special-token text (e.g. <|im_start|>) into its id")
    p.add_argument("--add-special", action="store_true", help="add the model's BOS/EOS as llama.cpp does")
    p.set_defaults(func=cmd_tokenize)

    from tensorserve import serve
    p = sub.add_parser("serve", help="start worker, scheduler and router on localhost (the embedded default)",
                       description=serve.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    serve.add_arguments(p)
    p.set_defaults(func=serve.run)

    for name, summary in (("router", "the public APIs: OpenAI-compatible HTTP and gRPC Generation"),
                          ("scheduler", "the engine loop: batching, KV blocks, streaming tokens"),
                          ("worker", "one device: weights, KV pool, forward pass, sampling")):
        module = importlib.import_module(f"{name}.main")
        p = sub.add_parser(name, help=f"start one {name} process: {summary}")
        module.add_arguments(p)
        p.set_defaults(func=module.run)

    p = sub.add_parser("score", help="teacher-forced top-k log-probabilities at every position of a token list")
    add_flags(p, ENGINE_OPTIONS)
    p.add_argument("--tokens-json", required=True, help="file holding a JSON list of token ids")
    p.add_argument("--top-k", type=int, default=8, help="alternatives per position (default 8)")
    p.set_defaults(func=cmd_score)
    return parser


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("tensorserve")
    except PackageNotFoundError:
        return "unknown (not installed)"


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from shared.errors import TensorServeError
    try:
        return args.func(args)
    except (TensorServeError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
