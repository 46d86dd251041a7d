"""Tiny, real GGUF files written with gguf-py's GGUFWriter, for tests.

`write_tiny_llama(path)` writes a random-weight 'llama' model small enough to
load in milliseconds (2 layers, d_model 64, 4 heads, 2 KV heads, FFN 128,
vocabulary 96). Keyword overrides change the hyper-parameters or damage the
file on purpose (drop a tensor, give one a wrong shape or another GGML type,
rename the architecture), so a test can write exactly the bad file it is about.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable, Mapping

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter, TokenType
from gguf.quants import quantize

T = GGMLQuantizationType

TINY_LLAMA = dict(n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, d_ff=128, vocab=96,
                  context_length=256, rope_base=10000.0, rms_eps=1e-5)


def tiny_llama_tensor_shapes(n_layers: int = 2, d_model: int = 64, n_heads: int = 4, n_kv_heads: int = 2,
                             d_ff: int = 128, vocab: int = 96, head_dim: int | None = None,
                             tie_output: bool = False) -> dict[str, tuple[int, ...]]:
    """Tensor name -> numpy-order shape ([out, in] for matrices) of a llama model."""
    hd = head_dim or d_model // n_heads
    shapes: dict[str, tuple[int, ...]] = {"token_embd.weight": (vocab, d_model), "output_norm.weight": (d_model,)}
    if not tie_output:
        shapes["output.weight"] = (vocab, d_model)
    for i in range(n_layers):
        p = f"blk.{i}."
        shapes.update({
            p + "attn_norm.weight": (d_model,),
            p + "attn_q.weight": (n_heads * hd, d_model),
            p + "attn_k.weight": (n_kv_heads * hd, d_model),
            p + "attn_v.weight": (n_kv_heads * hd, d_model),
            p + "attn_output.weight": (d_model, n_heads * hd),
            p + "ffn_norm.weight": (d_model,),
            p + "ffn_gate.weight": (d_ff, d_model),
            p + "ffn_up.weight": (d_ff, d_model),
            p + "ffn_down.weight": (d_model, d_ff),
        })
    return shapes


def _tensor_payload(data: np.ndarray, ggml_type: int, rng: np.random.Generator) -> tuple[np.ndarray, Any]:
    """(array to write, raw_dtype) for float32 `data` stored as `ggml_type`.

    F32/F16 are written natively; types gguf-py can quantize are quantized;
    any other type gets random bytes of the right size (enough to test that
    the loader rejects it)."""
    ggml_type = T(ggml_type)
    if ggml_type == T.F32:
        return data.astype(np.float32), None
    if ggml_type == T.F16:
        return data.astype(np.float16), None
    try:
        return quantize(data, ggml_type), ggml_type
    except NotImplementedError:
        block, type_size = GGML_QUANT_SIZES[ggml_type]
        if data.shape[-1] % block:
            raise ValueError(f"{ggml_type.name} needs rows that are a multiple of {block} values, "
                             f"got shape {data.shape}") from None
        row_bytes = data.shape[-1] // block * type_size
        raw = rng.integers(0, 256, size=(*data.shape[:-1], row_bytes), dtype=np.uint8)
        return raw, ggml_type


def write_tiny_llama(path: str | Path, *, architecture: str = "llama",
                     n_layers: int = 2, d_model: int = 64, n_heads: int = 4, n_kv_heads: int = 2,
                     d_ff: int = 128, vocab: int = 96, context_length: int = 256,
                     rope_base: float = 10000.0, rms_eps: float = 1e-5, seed: int = 0,
                     tie_output: bool = False,
                     drop: Iterable[str] = (),
                     shapes: Mapping[str, tuple[int, ...]] | None = None,
                     types: Mapping[str, int] | None = None,
                     default_matrix_type: int = T.F32,
                     metadata: Mapping[str, Any] | None = None,
                     skip_metadata: Iterable[str] = ()) -> Path:
    """Write a tiny random-weight llama GGUF to `path` and return the path.

    drop:       tensor names to leave out.
    shapes:     tensor name -> numpy-order shape to write instead of the right one.
    types:      tensor name -> GGMLQuantizationType to store it as (unsupported
                types are written as random bytes of the right size).
    default_matrix_type: GGML type of the 2-D tensors not named in `types`.
    metadata:   extra key -> value (str, int, float, bool) written as-is; keys
                are full names, e.g. {"llama.attention.sliding_window": 4}.
    skip_metadata: architecture keys (without the "<arch>." prefix, e.g.
                "attention.head_count") to leave out.
    """
    path = Path(path)
    rng = np.random.default_rng(seed)
    skip = set(skip_metadata)
    w = GGUFWriter(str(path), architecture)
    w.add_name("tiny-llama")
    arch_keys: dict[str, Any] = {
        "context_length": context_length,
        "embedding_length": d_model,
        "block_count": n_layers,
        "feed_forward_length": d_ff,
        "attention.head_count": n_heads,
        "attention.head_count_kv": n_kv_heads,
        "rope.dimension_count": d_model // n_heads,
        "vocab_size": vocab,
    }
    for key, value in arch_keys.items():
        if key not in skip:
            w.add_uint32(f"{architecture}.{key}", value)
    if "attention.layer_norm_rms_epsilon" not in skip:
        w.add_float32(f"{architecture}.attention.layer_norm_rms_epsilon", rms_eps)
    if "rope.freq_base" not in skip:
        w.add_float32(f"{architecture}.rope.freq_base", rope_base)
    w.add_tokenizer_model("llama")
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(vocab - 3)]
    w.add_token_list(tokens)
    w.add_token_scores([0.0] * vocab)
    w.add_token_types([TokenType.UNKNOWN, TokenType.CONTROL, TokenType.CONTROL] + [TokenType.BYTE] * (vocab - 3))
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    for key, value in (metadata or {}).items():
        if isinstance(value, bool):
            w.add_bool(key, value)
        elif isinstance(value, int):
            w.add_uint32(key, value)
        elif isinstance(value, float):
            w.add_float32(key, value)
        else:
            w.add_string(key, str(value))

    dropped = set(drop)
    overrides = dict(shapes or {})
    type_of = dict(types or {})
    for name, shape in tiny_llama_tensor_shapes(n_layers, d_model, n_heads, n_kv_heads, d_ff, vocab,
                                                tie_output=tie_output).items():
        if name in dropped:
            continue
        shape = tuple(overrides.get(name, shape))
        if len(shape) == 1:  # norm weights: around 1, like a trained model's
            data = (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
        else:
            data = (rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)
        ggml_type = type_of.get(name, default_matrix_type if len(shape) == 2 else T.F32)
        payload, raw_dtype = _tensor_payload(data, ggml_type, rng)
        w.add_tensor(name, payload, raw_dtype=raw_dtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
