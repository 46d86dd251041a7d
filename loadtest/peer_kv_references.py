"""llama.cpp's teacher-forced top-8 at every fixture position with a quantized KV cache: the
references `tests/test_agreement.py` holds our --kv-cache-dtype q8_0 to (tests/fixtures/kv-q8_0/).

llama.cpp's own q8_0 cache misses the f16 references (tests/fixtures/<model>.json) at some of
their near-ties, as ours does, so the strict bar for a quantized cache is against llama.cpp with
the same cache type. Run with a Python that has llama-cpp-python (docs/BENCHMARKS.md, "How to
reproduce"):

    /work/peer-venv/bin/python loadtest/peer_kv_references.py --model PATH.gguf \\
        --fixture tests/fixtures/smollm2-135m.json --cache-type q8_0 --out tests/fixtures/kv-q8_0/smollm2-135m.json
"""
from __future__ import annotations

import argparse
import json
import logging
import platform

import numpy as np

import llama_cpp

CACHE_TYPES = {"f16": 1, "q8_0": 8, "q4_0": 2}     # ggml_type numbers
TOP_K = 8


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="the GGUF file of the fixture's model")
    parser.add_argument("--fixture", required=True, help="tests/fixtures/<model>.json (its cases' tokens)")
    parser.add_argument("--cache-type", choices=sorted(CACHE_TYPES), default="q8_0")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    logging.getLogger("llama-cpp-python").setLevel(logging.CRITICAL + 1)
    fixture = json.load(open(args.fixture))
    longest = max(len(c["prompt_tokens"]) + len(c["greedy_continuation"]) for c in fixture["generate"])
    kv_type = CACHE_TYPES[args.cache_type]
    # a quantized V cache needs flash attention in llama.cpp
    llm = llama_cpp.Llama(model_path=args.model, n_ctx=max(512, longest + 16), n_threads=args.threads, n_batch=512,
                          logits_all=True, type_k=kv_type, type_v=kv_type, flash_attn=True, verbose=False)
    cases = []
    for case in fixture["generate"]:
        tokens = case["prompt_tokens"] + case["greedy_continuation"]
        llm.reset()
        llm.eval(tokens)
        scores = np.asarray(llm.scores[:len(tokens)], dtype=np.float64)
        rows = []
        for row in scores[:len(case["teacher_forced"])]:
            top = np.argsort(-row, kind="stable")[:TOP_K]
            peak = row.max()
            lse = float(np.log(np.exp(row - peak).sum()) + peak)
            rows.append({"top_ids": [int(t) for t in top], "top_logits": [round(float(row[t]), 5) for t in top],
                         "logsumexp": round(lse, 5)})
        cases.append({"name": case["name"], "teacher_forced": rows})
    out = {"model": fixture["model"], "gguf_file": fixture.get("gguf_file"), "kv_cache_type": args.cache_type,
           "reference": f"llama.cpp CPU backend (vendored in llama-cpp-python {llama_cpp.__version__}), "
                        f"{args.threads} threads, flash attention, K and V cache {args.cache_type}, f32 logits",
           "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
           "system_info": llama_cpp.llama_print_system_info().decode().strip(),
           "notes": "teacher_forced[i]: the logits after tokens[0..i] of the main fixture's prompt_tokens + "
                    "greedy_continuation, as there; made by loadtest/peer_kv_references.py",
           "generate": cases}
    with open(args.out, "w") as f:
        json.dump(out, f, separators=(",", ":"))
    print(f"wrote {args.out}: {len(cases)} cases")


if __name__ == "__main__":
    main()
