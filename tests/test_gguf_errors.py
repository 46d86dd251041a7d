"""Bad GGUF files fail with an error that names the file and the problem.

Every case writes its own bad file (tiny real GGUFs from tests/tiny_models.py,
damaged on purpose) and loads it the way the worker does, through
worker.model_runner.ModelRunner; the file-level cases also go through
shared.gguf_file.GGUFFile directly.
"""
from __future__ import annotations

import math
import struct
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tiny_models import T, write_tiny_llama  # noqa: E402

from shared.dequant import SUPPORTED_TYPES  # noqa: E402
from shared.errors import GGUFError, UnsupportedTensorType  # noqa: E402
from shared.gguf_file import GGUFFile  # noqa: E402
from shared.model_config import ModelConfig  # noqa: E402
from worker.model_runner import ModelRunner  # noqa: E402

KV_MEMORY = 4 * 2**20   # the tiny model needs a few hundred KiB of KV; keep the pool small


def load(path: Path) -> ModelRunner:
    return ModelRunner(path, kv_memory=KV_MEMORY)


def expect_error(fn, path: Path, *fragments: str, exc_type: type[GGUFError] = GGUFError) -> GGUFError:
    """fn(path) raises exc_type whose message names the file and contains every fragment."""
    with pytest.raises(exc_type) as info:
        fn(path)
    msg = str(info.value)
    assert str(path) in msg, f"message does not name the file: {msg}"
    for fragment in fragments:
        assert fragment in msg, f"{fragment!r} not in message: {msg}"
    assert info.value.path == Path(path)
    return info.value


@pytest.fixture(scope="module")
def tiny_bytes(tmp_path_factory) -> bytes:
    return write_tiny_llama(tmp_path_factory.mktemp("tiny") / "tiny.gguf").read_bytes()


# --- the good file ------------------------------------------------------------------


def test_tiny_llama_loads_and_scores(tmp_path):
    from tensorserve.local import LocalEngine

    path = write_tiny_llama(tmp_path / "tiny.gguf")
    engine = LocalEngine(path, kv_memory=KV_MEMORY, load_tokenizer=False)
    c = engine.config
    assert (c.architecture, c.n_layers, c.d_model, c.n_heads, c.n_kv_heads, c.head_dim, c.d_ff, c.vocab_size) == \
        ("llama", 2, 64, 4, 2, 16, 128, 96)
    tokens = [1, 5, 9, 20, 33, 7, 95, 3]
    rows = engine.score(tokens, top_k=4)
    assert len(rows) == len(tokens)
    for row in rows:
        assert len(row["top_ids"]) == 4 and len(set(row["top_ids"])) == 4
        assert all(0 <= i < 96 for i in row["top_ids"])
        lps = row["top_logprobs"]
        assert all(math.isfinite(v) and v <= 0.0 for v in lps)
        assert lps == sorted(lps, reverse=True)
        assert sum(math.exp(v) for v in lps) <= 1.0 + 1e-5


@pytest.mark.parametrize("matrix_type", [T.F16, T.Q8_0, T.Q4_0])
def test_tiny_llama_quantized_matrices_load(tmp_path, matrix_type):
    path = write_tiny_llama(tmp_path / "tiny.gguf", default_matrix_type=matrix_type, tie_output=True)
    runner = load(path)
    assert runner.gguf.tensors["blk.0.attn_q.weight"].ggml_type == matrix_type
    assert "output.weight" not in runner.gguf.tensors


# --- (a) not a GGUF -------------------------------------------------------------------


@pytest.mark.parametrize("loader", [GGUFFile, load], ids=["GGUFFile", "ModelRunner"])
def test_text_file_is_not_gguf(tmp_path, loader):
    path = tmp_path / "notes.gguf"
    path.write_text("this is a text file, not a model\n")
    expect_error(loader, path, "not a GGUF file", "b'GGUF'")


@pytest.mark.parametrize("loader", [GGUFFile, load], ids=["GGUFFile", "ModelRunner"])
def test_empty_file_is_not_gguf(tmp_path, loader):
    path = tmp_path / "empty.gguf"
    path.write_bytes(b"")
    expect_error(loader, path, "not a GGUF file", "empty")


def test_file_shorter_than_magic(tmp_path):
    path = tmp_path / "short.gguf"
    path.write_bytes(b"GG")
    expect_error(GGUFFile, path, "not a GGUF file")


def test_missing_file(tmp_path):
    expect_error(load, tmp_path / "nowhere.gguf", "no such file")


def test_unsupported_gguf_version(tmp_path, tiny_bytes):
    path = tmp_path / "v9.gguf"
    path.write_bytes(tiny_bytes[:4] + struct.pack("<I", 9) + tiny_bytes[8:])
    expect_error(load, path, "unsupported GGUF version 9")


def test_corrupt_metadata_value_type(tmp_path, tiny_bytes):
    data = bytearray(tiny_bytes)
    key = b"llama.block_count"
    struct.pack_into("<I", data, data.index(key) + len(key), 77)   # the key's value type
    path = tmp_path / "corrupt.gguf"
    path.write_bytes(bytes(data))
    expect_error(load, path, "corrupt header")


# --- (b) truncated --------------------------------------------------------------------


@pytest.mark.parametrize("loader", [GGUFFile, load], ids=["GGUFFile", "ModelRunner"])
def test_truncated_in_tensor_data(tmp_path, tiny_bytes, loader):
    path = tmp_path / "half.gguf"
    path.write_bytes(tiny_bytes[:len(tiny_bytes) // 2])
    err = expect_error(loader, path, "truncated", "cut short")
    assert "tensor '" in str(err)   # names the first tensor that does not fit


@pytest.mark.parametrize("where", ["version", "counts", "metadata", "tensor_infos", "data_start"])
@pytest.mark.parametrize("loader", [GGUFFile, load], ids=["GGUFFile", "ModelRunner"])
def test_truncated_in_header(tmp_path, tiny_bytes, where, loader):
    full = tmp_path / "full.gguf"
    full.write_bytes(tiny_bytes)
    data_offset = GGUFFile(full).data_offset
    first_tensor = tiny_bytes.index(b"token_embd.weight")
    cut = {"version": 6, "counts": 14, "metadata": first_tensor // 2,
           "tensor_infos": (first_tensor + data_offset) // 2, "data_start": data_offset}[where]
    path = tmp_path / f"cut_{where}.gguf"
    path.write_bytes(tiny_bytes[:cut])
    err = expect_error(loader, path, "truncated")
    assert str(err).count(str(path)) == 1, f"the path is repeated: {err}"


# --- (c) unsupported architecture -----------------------------------------------------


def test_unsupported_architecture(tmp_path):
    path = write_tiny_llama(tmp_path / "mamba.gguf", architecture="mamba9")
    expect_error(load, path, "unsupported architecture 'mamba9'", "dream, gemma3, llada, llama")


def test_unsupported_architecture_without_llama_metadata(tmp_path):
    """A real file of another architecture lacks the keys a llama config reads: the architecture is still what is reported."""
    path = write_tiny_llama(tmp_path / "mamba.gguf", architecture="mamba9",
                            skip_metadata=["attention.head_count", "attention.head_count_kv",
                                           "feed_forward_length", "attention.layer_norm_rms_epsilon"])
    expect_error(load, path, "unsupported architecture 'mamba9'", "dream, gemma3, llada, llama")


def test_missing_metadata_key(tmp_path):
    path = write_tiny_llama(tmp_path / "nokey.gguf", skip_metadata=["embedding_length"])
    expect_error(load, path, "llama.embedding_length", "missing")


# --- (d) unsupported tensor type -------------------------------------------------------


@pytest.mark.parametrize("ggml_type, tensor, overrides", [
    (T.IQ4_NL, "blk.0.attn_q.weight", {}),
    (T.IQ2_XXS, "blk.1.ffn_down.weight", {"d_ff": 256}),   # IQ2_XXS rows are multiples of 256 values
    (T.Q8_1, "token_embd.weight", {}),
])
def test_unsupported_tensor_type(tmp_path, ggml_type, tensor, overrides):
    assert ggml_type not in SUPPORTED_TYPES
    path = write_tiny_llama(tmp_path / "quant.gguf", types={tensor: ggml_type}, **overrides)
    assert GGUFFile(path).tensors[tensor].ggml_type == ggml_type
    expect_error(load, path, f"'{tensor}'", f"unsupported type {ggml_type.name}", "Q8_0",
                 exc_type=UnsupportedTensorType)


def test_unknown_tensor_type_id(tmp_path, tiny_bytes):
    """A type id newer than this gguf-py (patched into the tensor directory) is reported, not crashed on."""
    data = bytearray(tiny_bytes)
    name = b"blk.0.attn_v.weight"
    at = data.index(name) + len(name)
    n_dims = struct.unpack_from("<I", data, at)[0]
    struct.pack_into("<I", data, at + 4 + 8 * n_dims, 250)
    path = tmp_path / "future.gguf"
    path.write_bytes(bytes(data))
    expect_error(load, path, "'blk.0.attn_v.weight'", "unsupported type 250", exc_type=UnsupportedTensorType)


# --- (e) missing tensor -------------------------------------------------------------------


def test_missing_tensor(tmp_path):
    path = write_tiny_llama(tmp_path / "missing.gguf", drop=["blk.1.ffn_up.weight"])
    expect_error(load, path, "missing tensor 'blk.1.ffn_up.weight'", "(128, 64)")


def test_missing_output_norm(tmp_path):
    path = write_tiny_llama(tmp_path / "missing.gguf", drop=["output_norm.weight"])
    expect_error(load, path, "missing tensor 'output_norm.weight'")


# --- (f) wrong shape ------------------------------------------------------------------------


@pytest.mark.parametrize("tensor, wrong, expected", [
    ("blk.0.attn_k.weight", (64, 64), (32, 64)),       # a K projection for 4 KV heads in a 2-KV-head model
    ("blk.1.ffn_down.weight", (64, 96), (64, 128)),
    ("blk.1.attn_norm.weight", (32,), (64,)),
    ("token_embd.weight", (100, 64), (96, 64)),        # embedding and vocabulary disagree
])
def test_wrong_tensor_shape(tmp_path, tensor, wrong, expected):
    path = write_tiny_llama(tmp_path / "shape.gguf", shapes={tensor: wrong})
    expect_error(load, path, f"'{tensor}'", f"has shape {wrong}", f"expected {expected}")


def test_wrong_shape_reported_before_unsupported_type(tmp_path):
    """Both wrong: the shape (what the metadata promises) is the first thing to fix."""
    path = write_tiny_llama(tmp_path / "both.gguf", shapes={"blk.0.attn_q.weight": (32, 64)},
                            types={"blk.0.attn_q.weight": T.IQ4_NL})
    expect_error(load, path, "'blk.0.attn_q.weight'", "has shape (32, 64)", "expected (64, 64)")


def test_config_matches_writer(tmp_path):
    path = write_tiny_llama(tmp_path / "cfg.gguf", n_layers=3, d_model=32, n_heads=2, n_kv_heads=1, d_ff=48,
                            vocab=40, rope_base=5000.0)
    c = ModelConfig.from_gguf(GGUFFile(path))
    assert (c.n_layers, c.d_model, c.n_heads, c.n_kv_heads, c.head_dim, c.d_ff, c.vocab_size, c.rope_base) == \
        (3, 32, 2, 1, 16, 48, 40, 5000.0)
    runner = load(path)
    assert np.isfinite(runner.model.output.dense).all()


def test_no_architecture_key(tmp_path, tiny_bytes):
    path = tmp_path / "noarch.gguf"
    path.write_bytes(tiny_bytes.replace(b"general.architecture", b"general.architecturX", 1))
    expect_error(load, path, "no general.architecture", "dream, gemma3, llada, llama")
