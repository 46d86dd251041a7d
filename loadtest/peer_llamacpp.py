#!/usr/bin/env python3
"""Peer benchmark: llama.cpp (via llama-cpp-python's low-level ctypes API).

Run this with the PEER venv's interpreter, not the TensorServe venv, e.g.

    /work/peer-venv/bin/python loadtest/peer_llamacpp.py --model M.gguf --json

It imports only llama_cpp, numpy, psutil and the standard library, so it does
not depend on anything in this repository.

What it measures on one GGUF, CPU only, n_threads = n_threads_batch = --threads:

  (a) prefill tok/s: --prompt-tokens random non-special token ids (fixed seed)
      sent as ONE llama_decode call (n_batch = n_ubatch = prompt length,
      logits for the last token only).  One warm-up, then best of --repeats,
      with the KV cache cleared before every run.
  (b) decode tok/s: single sequence, greedy, --decode-tokens tokens after a
      short prompt; only the per-token llama_decode calls are timed (argmax
      and batch filling are not).  Best of --repeats.
  (c) batched decode tok/s: one context with n_seq_max = --batch; every
      sequence gets its own short random prompt (all prompts prefilled in one
      batch, untimed), then --batch-steps steps that each decode one token per
      sequence (--batch tokens per llama_decode).  Reports total generated
      tokens / summed decode time.  Best of --repeats.
  (d) peak RSS of this process (MiB), from /proc/self/status VmHWM.

llama.cpp's own log output is silenced; --verbose turns it back on.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import logging
import os
import resource
import sys
import time

import numpy as np
import psutil

import llama_cpp
from llama_cpp import llama_cpp as L

SEED = 1234
SHORT_PROMPT_TOKENS = 16  # BOS (if the model wants one) + random tokens


# --------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------


def _silence_llama_logs(verbose: bool) -> None:
    # llama_cpp._logger installs a log callback that prints everything unless
    # the "llama-cpp-python" logger level is raised.
    logging.getLogger("llama-cpp-python").setLevel(
        logging.DEBUG if verbose else logging.CRITICAL + 1
    )


def _peak_rss_mib() -> float:
    # VmHWM is this process's own peak; ru_maxrss would include a forking parent's RSS
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024.0
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def _normal_token_ids(vocab, n_vocab: int) -> np.ndarray:
    """All token ids that are plain text pieces (no control / unknown /
    unused / user-defined special tokens, no end-of-generation tokens)."""
    bad = (
        L.LLAMA_TOKEN_ATTR_UNKNOWN
        | L.LLAMA_TOKEN_ATTR_UNUSED
        | L.LLAMA_TOKEN_ATTR_CONTROL
        | L.LLAMA_TOKEN_ATTR_USER_DEFINED
    )
    good = L.LLAMA_TOKEN_ATTR_NORMAL | L.LLAMA_TOKEN_ATTR_BYTE
    ids = []
    for t in range(n_vocab):
        attr = L.llama_vocab_get_attr(vocab, t)
        if attr & bad or not attr & good:
            continue
        if L.llama_vocab_is_eog(vocab, t):
            continue
        ids.append(t)
    if not ids:
        raise RuntimeError("no non-special tokens found in vocab")
    return np.asarray(ids, dtype=np.int32)


class Batch:
    """Thin wrapper over llama_batch_init / llama_batch_free."""

    def __init__(self, n_tokens: int, n_seq_max: int):
        self.cap = n_tokens
        self.b = L.llama_batch_init(n_tokens, 0, n_seq_max)
        self.b.n_tokens = 0

    def clear(self) -> None:
        self.b.n_tokens = 0

    def add(self, token: int, pos: int, seq_id: int, logits: bool) -> None:
        i = self.b.n_tokens
        if i >= self.cap:
            raise RuntimeError("batch overflow")
        self.b.token[i] = int(token)
        self.b.pos[i] = int(pos)
        self.b.n_seq_id[i] = 1
        self.b.seq_id[i][0] = int(seq_id)
        self.b.logits[i] = 1 if logits else 0
        self.b.n_tokens = i + 1

    def free(self) -> None:
        if self.b is not None:
            L.llama_batch_free(self.b)
            self.b = None


_FLASH_ATTN = {
    "auto": L.LLAMA_FLASH_ATTN_TYPE_AUTO,
    "on": L.LLAMA_FLASH_ATTN_TYPE_ENABLED,
    "off": L.LLAMA_FLASH_ATTN_TYPE_DISABLED,
}
_flash_attn_choice = "auto"


def _new_context(model, *, n_ctx, n_batch, n_seq_max, threads):
    p = L.llama_context_default_params()
    p.flash_attn_type = _FLASH_ATTN[_flash_attn_choice]
    p.n_ctx = n_ctx
    p.n_batch = n_batch
    p.n_ubatch = n_batch
    p.n_seq_max = n_seq_max
    p.n_threads = threads
    p.n_threads_batch = threads
    p.no_perf = True
    ctx = L.llama_init_from_model(model, p)
    if not ctx:
        raise RuntimeError(
            f"llama_init_from_model failed (n_ctx={n_ctx}, n_batch={n_batch}, "
            f"n_seq_max={n_seq_max})"
        )
    return ctx


def _decode(ctx, batch: Batch) -> float:
    """Run llama_decode on the batch; return elapsed seconds."""
    t0 = time.perf_counter()
    rc = L.llama_decode(ctx, batch.b)
    L.llama_synchronize(ctx)
    dt = time.perf_counter() - t0
    if rc != 0:
        raise RuntimeError(f"llama_decode returned {rc}")
    return dt


def _logits(ctx, n_rows: int, n_vocab: int) -> np.ndarray:
    ptr = L.llama_get_logits(ctx)
    return np.ctypeslib.as_array(ptr, shape=(n_rows * n_vocab,)).reshape(
        n_rows, n_vocab
    )


def _short_prompt(rng, normal_ids, bos, add_bos, n) -> list[int]:
    toks = rng.choice(normal_ids, size=n - (1 if add_bos else 0)).tolist()
    return ([bos] if add_bos else []) + toks


# --------------------------------------------------------------------------
# benchmarks
# --------------------------------------------------------------------------


def bench_prefill(ctx, mem, normal_ids, n_prompt, repeats):
    rng = np.random.default_rng(SEED)
    prompt = rng.choice(normal_ids, size=n_prompt).tolist()
    batch = Batch(n_prompt, 1)
    try:
        times = []
        for run in range(repeats + 1):  # first run is the warm-up
            L.llama_memory_clear(mem, True)
            batch.clear()
            for i, t in enumerate(prompt):
                batch.add(t, i, 0, i == n_prompt - 1)
            dt = _decode(ctx, batch)
            if run > 0:
                times.append(dt)
    finally:
        batch.free()
    L.llama_memory_clear(mem, True)
    return n_prompt / min(times), times


def bench_decode(ctx, mem, normal_ids, n_vocab, bos, add_bos, n_decode, repeats):
    rng = np.random.default_rng(SEED + 1)
    prompt = _short_prompt(rng, normal_ids, bos, add_bos, SHORT_PROMPT_TOKENS)
    batch = Batch(max(len(prompt), 1), 1)
    rates = []
    try:
        for _ in range(repeats):
            L.llama_memory_clear(mem, True)
            batch.clear()
            for i, t in enumerate(prompt):
                batch.add(t, i, 0, i == len(prompt) - 1)
            _decode(ctx, batch)  # prompt: not timed
            pos = len(prompt)
            tok = int(np.argmax(_logits(ctx, 1, n_vocab)[0]))
            total = 0.0
            for _ in range(n_decode):
                batch.clear()
                batch.add(tok, pos, 0, True)
                total += _decode(ctx, batch)
                pos += 1
                tok = int(np.argmax(_logits(ctx, 1, n_vocab)[0]))
            rates.append(n_decode / total)
    finally:
        batch.free()
    L.llama_memory_clear(mem, True)
    return max(rates), rates


def bench_batched(model, normal_ids, n_vocab, bos, add_bos, n_seq, n_steps,
                  threads, repeats):
    plen = SHORT_PROMPT_TOKENS
    need_per_seq = plen + n_steps + 8
    # Non-unified KV: each sequence gets n_ctx / n_seq_max cells, padded to 256.
    per_seq = ((need_per_seq + 255) // 256) * 256
    n_ctx = per_seq * n_seq
    n_batch = max(512, n_seq * plen)
    ctx = _new_context(model, n_ctx=n_ctx, n_batch=n_batch, n_seq_max=n_seq,
                       threads=threads)
    mem = L.llama_get_memory(ctx)
    rng = np.random.default_rng(SEED + 2)
    prompts = [_short_prompt(rng, normal_ids, bos, add_bos, plen)
               for _ in range(n_seq)]
    batch = Batch(n_batch, n_seq)
    rates = []
    try:
        for _ in range(repeats):
            L.llama_memory_clear(mem, True)
            # prefill all prompts in one batch (untimed); logits on each last token
            batch.clear()
            for s, pr in enumerate(prompts):
                for i, t in enumerate(pr):
                    batch.add(t, i, s, i == len(pr) - 1)
            _decode(ctx, batch)
            toks = np.argmax(_logits(ctx, n_seq, n_vocab), axis=1)
            pos = plen
            total = 0.0
            for _ in range(n_steps):
                batch.clear()
                for s in range(n_seq):
                    batch.add(int(toks[s]), pos, s, True)
                total += _decode(ctx, batch)
                pos += 1
                toks = np.argmax(_logits(ctx, n_seq, n_vocab), axis=1)
            rates.append(n_seq * n_steps / total)
    finally:
        batch.free()
        L.llama_free(ctx)
    return max(rates), rates


# --------------------------------------------------------------------------
# main
# --------------------------------------------------------------------------


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True, help="path to a GGUF file")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--batch", type=int, default=32,
                    help="number of sequences in the batched-decode test")
    ap.add_argument("--batch-steps", type=int, default=32,
                    help="decode steps in the batched-decode test")
    ap.add_argument("--repeats", type=int, default=3,
                    help="timed runs per test (best is reported)")
    ap.add_argument("--flash-attn", choices=sorted(_FLASH_ATTN), default="auto",
                    help="llama.cpp flash-attention setting (default: llama.cpp's auto)")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--verbose", action="store_true",
                    help="show llama.cpp's own log output on stderr")
    args = ap.parse_args(argv)

    if not os.path.isfile(args.model):
        ap.error(f"model not found: {args.model}")

    global _flash_attn_choice
    _flash_attn_choice = args.flash_attn
    _silence_llama_logs(args.verbose)
    t_start = time.perf_counter()
    L.llama_backend_init()

    mp = L.llama_model_default_params()
    mp.n_gpu_layers = 0
    model = L.llama_model_load_from_file(args.model.encode(), mp)
    if not model:
        print(f"failed to load {args.model}", file=sys.stderr)
        return 1
    vocab = L.llama_model_get_vocab(model)
    n_vocab = L.llama_vocab_n_tokens(vocab)
    bos = L.llama_vocab_bos(vocab)
    add_bos = bool(L.llama_vocab_get_add_bos(vocab)) and bos >= 0
    desc_buf = ctypes.create_string_buffer(256)
    L.llama_model_desc(model, desc_buf, ctypes.sizeof(desc_buf))
    normal_ids = _normal_token_ids(vocab, n_vocab)

    # Single-sequence context for prefill + single decode.
    n_ctx1 = args.prompt_tokens + SHORT_PROMPT_TOKENS + args.decode_tokens + 64
    n_ctx1 = max(1024, ((n_ctx1 + 255) // 256) * 256)
    ctx = _new_context(model, n_ctx=n_ctx1, n_batch=args.prompt_tokens,
                       n_seq_max=1, threads=args.threads)
    mem = L.llama_get_memory(ctx)
    try:
        prefill, prefill_runs = bench_prefill(
            ctx, mem, normal_ids, args.prompt_tokens, args.repeats)
        decode, decode_runs = bench_decode(
            ctx, mem, normal_ids, n_vocab, bos, add_bos, args.decode_tokens,
            args.repeats)
    finally:
        L.llama_free(ctx)

    batched, batched_runs = bench_batched(
        model, normal_ids, n_vocab, bos, add_bos, args.batch, args.batch_steps,
        args.threads, max(1, min(args.repeats, 2)))

    peak = _peak_rss_mib()
    L.llama_model_free(model)
    L.llama_backend_free()

    result = {
        "prefill_tok_s": round(prefill, 2),
        "decode_tok_s": round(decode, 2),
        "batch32_decode_tok_s": round(batched, 2),
        "peak_rss_mib": round(peak, 1),
        "llama_cpp_version": llama_cpp.__version__,
        # extra context for whoever reads the numbers
        "model": os.path.basename(args.model),
        "model_desc": desc_buf.value.decode(errors="replace"),
        "n_threads": args.threads,
        "flash_attn": args.flash_attn,
        "prompt_tokens": args.prompt_tokens,
        "decode_tokens": args.decode_tokens,
        "batch_seqs": args.batch,
        "batch_steps": args.batch_steps,
        "prefill_runs_s": [round(t, 4) for t in prefill_runs],
        "decode_runs_tok_s": [round(r, 2) for r in decode_runs],
        "batch_runs_tok_s": [round(r, 2) for r in batched_runs],
        "loadavg_1m_at_end": round(os.getloadavg()[0], 2),
        "wall_s": round(time.perf_counter() - t_start, 1),
    }
    if args.batch != 32:
        # keep the documented key but make clear what it measured
        result["batch_decode_note"] = f"batch32_decode_tok_s measured with {args.batch} seqs"

    if args.json:
        print(json.dumps(result))
    else:
        rows = [
            ("model", f"{result['model']} ({result['model_desc']})"),
            ("llama-cpp-python", result["llama_cpp_version"]),
            ("threads", str(args.threads)),
            (f"prefill ({args.prompt_tokens} tok, 1 decode call)", f"{prefill:10.1f} tok/s"),
            (f"decode (1 seq, {args.decode_tokens} tok)", f"{decode:10.1f} tok/s"),
            (f"decode ({args.batch} seqs x {args.batch_steps} steps)", f"{batched:10.1f} tok/s"),
            ("peak RSS", f"{peak:10.1f} MiB"),
            ("1-min load avg at end", f"{result['loadavg_1m_at_end']:10.2f}"),
            ("wall time", f"{result['wall_s']:10.1f} s"),
        ]
        w = max(len(k) for k, _ in rows)
        for k, v in rows:
            print(f"{k:<{w}}  {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
