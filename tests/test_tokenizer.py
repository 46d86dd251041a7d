"""Tokenizer against llama.cpp's tokenizations of the two bundled models (tests/fixtures)."""
from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from router.tokenizer import Tokenizer
from shared.errors import ModelNotFound
from shared.gguf_file import GGUFFile
from shared.model_registry import resolve_model

FIXTURES = Path(__file__).parent / "fixtures"
MODELS = ("smollm2-135m", "gemma3-270m")
REFERENCE = {m: json.loads((FIXTURES / f"{m}.json").read_text()) for m in MODELS}
_metadata_cache: dict[str, dict] = {}


def load_metadata(model: str) -> dict:
    if model not in _metadata_cache:
        try:
            path = resolve_model(model)
        except ModelNotFound as exc:
            pytest.skip(str(exc))
        _metadata_cache[model] = GGUFFile(path).metadata
    return _metadata_cache[model]


@pytest.fixture(scope="module")
def tokenizers() -> dict[str, Tokenizer]:
    return {m: Tokenizer.from_metadata(load_metadata(m)) for m in MODELS}


def _tokenize_cases() -> list:
    return [pytest.param(model, entry, id=f"{model}-{i}")
            for model in MODELS for i, entry in enumerate(REFERENCE[model]["tokenize"])]


def _prompt_cases() -> list:
    return [pytest.param(model, case, id=f"{model}-{case['name']}")
            for model in MODELS for case in REFERENCE[model]["generate"]]


def test_fixtures_have_all_cases():
    for model in MODELS:
        assert len(REFERENCE[model]["tokenize"]) == 48


@pytest.mark.parametrize("model,entry", _tokenize_cases())
def test_matches_llama_cpp(tokenizers, model, entry):
    tok, text = tokenizers[model], entry["text"]
    assert tok.encode(text) == entry["tokens"]
    assert tok.encode(text, parse_special=True) == entry["tokens_parse_special"]
    assert tok.encode(text, add_special=True) == entry["tokens_add_special"]


@pytest.mark.parametrize("model,case", _prompt_cases())
def test_generate_prompts_tokenize_like_llama_cpp(tokenizers, model, case):
    text = case["rendered_prompt"] if "messages" in case else case["prompt_text"]
    assert tokenizers[model].encode(text, add_special=True, parse_special=True) == case["prompt_tokens"]


@pytest.mark.parametrize("model", MODELS)
def test_decode_round_trips(tokenizers, model):
    tok = tokenizers[model]
    for entry in REFERENCE[model]["tokenize"]:
        assert tok.decode(tok.encode(entry["text"])) == entry["text"]


def test_special_ids_smollm2(tokenizers):
    tok = tokenizers["smollm2-135m"]
    assert tok.vocab_size == 49152
    assert (tok.bos_id, tok.eos_id) == (1, 2)
    assert (tok.bos_text, tok.eos_text) == ("<|im_start|>", "<|im_end|>")
    assert not tok.add_bos and not tok.add_eos
    # llama.cpp: eos, <|endoftext|> (end-of-generation text) and <reponame> (FIM repo token)
    assert tok.eos_ids == frozenset({0, 2, 4})
    assert tok.is_special(1) and not tok.is_special(tok.encode("Hello")[0])


def test_special_ids_gemma3(tokenizers):
    tok = tokenizers["gemma3-270m"]
    assert tok.vocab_size == 262144
    assert (tok.bos_id, tok.eos_id, tok.bos_text, tok.eos_text) == (2, 1, "<bos>", "<eos>")
    assert tok.add_bos and not tok.add_eos
    end_of_turn = tok.token_id("<end_of_turn>")
    assert {1, end_of_turn} <= tok.eos_ids
    assert tok.is_special(end_of_turn)
    assert not tok.is_special(tok.token_id("\n\n"))  # user-defined: ordinary text


def test_user_defined_tokens_are_split_out_without_parse_special(tokenizers):
    tok = tokenizers["gemma3-270m"]
    three_spaces, newline = tok.token_id("   "), tok.token_id("\n")
    assert tok.encode("a   b\n") == [tok.encode("a")[0], three_spaces, *tok.encode("b"), newline]
    # control tokens only with parse_special
    assert tok.encode("<start_of_turn>", parse_special=True) == [tok.token_id("<start_of_turn>")]
    assert tok.token_id("<start_of_turn>") not in tok.encode("<start_of_turn>")


def test_token_bytes(tokenizers):
    smol, gemma = tokenizers["smollm2-135m"], tokenizers["gemma3-270m"]
    assert smol.token_bytes(smol.token_id("Ġthe")) == b" the"
    assert smol.token_bytes(smol.token_id("Ċ")) == b"\n"
    assert smol.token_bytes(1) == b"<|im_start|>"
    assert gemma.token_bytes(gemma.token_id("<0x0A>")) == b"\n"
    assert gemma.token_bytes(gemma.token_id("<0xF0>")) == b"\xf0"
    assert gemma.token_bytes(gemma.token_id("▁the")) == b" the"
    assert gemma.token_bytes(2) == b"<bos>"
    with pytest.raises(ValueError, match="outside the vocabulary"):
        gemma.token_bytes(gemma.vocab_size)


def test_decode_skip_special(tokenizers):
    tok = tokenizers["smollm2-135m"]
    ids = tok.encode("<|im_start|>user\nHi<|im_end|>", parse_special=True)
    assert tok.decode(ids) == "user\nHi"
    assert tok.decode(ids, skip_special=False) == "<|im_start|>user\nHi<|im_end|>"


def test_tiny_llada_mask_token():
    tok = Tokenizer.from_metadata(GGUFFile(FIXTURES / "diffusion" / "tiny-llada.gguf").metadata)
    assert tok.vocab_size == 49153
    assert tok.mask_id == 49152
    assert tok.encode("<|mdm_mask|>", parse_special=True) == [49152]
    assert 49152 not in tok.encode("<|mdm_mask|>")
    assert tok.encode("a<|mdm_mask|><|mdm_mask|>b", parse_special=True) == [*tok.encode("a"), 49152, 49152,
                                                                             *tok.encode("b")]


def test_diffusion_prompts_tokenize_like_llama_cpp():
    ref = json.loads((FIXTURES / "diffusion" / "tiny-llada.json").read_text())
    tok = Tokenizer.from_metadata(GGUFFile(FIXTURES / "diffusion" / "tiny-llada.gguf").metadata)
    for run in ref["cli"]:
        assert tok.encode(run["rendered_prompt"], add_special=True, parse_special=True) == run["prompt_tokens"]


def test_gemma_tokenizer_builds_fast():
    md = load_metadata("gemma3-270m")
    start = time.perf_counter()
    Tokenizer.from_metadata(md)
    assert time.perf_counter() - start < 5.0  # about 1 s; a generous bound for a shared machine


def test_other_bpe_pre_tokenizers():
    md = load_metadata("smollm2-135m")
    smollm = Tokenizer.from_metadata(md)
    gpt2 = Tokenizer.from_metadata({**md, "tokenizer.ggml.pre": "gpt-2"})
    llama3 = Tokenizer.from_metadata({**md, "tokenizer.ggml.pre": "llama3"})
    default = Tokenizer.from_metadata({**md, "tokenizer.ggml.pre": "default"})
    assert len(smollm.encode("1234567")) == 7  # digits one by one
    for tok in (gpt2, llama3, default):
        assert tok.decode(tok.encode("Hello, world! 12345")) == "Hello, world! 12345"
    assert not llama3.add_bos  # the GGUF says so...
    unsaid = {k: v for k, v in md.items() if k != "tokenizer.ggml.add_bos_token"}
    assert Tokenizer.from_metadata({**unsaid, "tokenizer.ggml.pre": "llama3"}).add_bos  # ...else llama.cpp's default
    assert not Tokenizer.from_metadata(unsaid).add_bos


def test_rejects_unsupported_vocabularies():
    md = load_metadata("smollm2-135m")
    with pytest.raises(ValueError, match="pre-tokenizer"):
        Tokenizer.from_metadata({**md, "tokenizer.ggml.pre": "no-such-pre"})
    with pytest.raises(ValueError, match="tokenizer model"):
        Tokenizer.from_metadata({**md, "tokenizer.ggml.model": "t5"})
    with pytest.raises(ValueError, match="tokens"):
        Tokenizer.from_metadata({"tokenizer.ggml.model": "gpt2"})
