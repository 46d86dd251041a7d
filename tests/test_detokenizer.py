"""Streaming detokenization never emits half a character, for both bundled vocabularies."""
from __future__ import annotations

import pytest

from router.detokenizer import IncrementalDetokenizer
from router.tokenizer import Tokenizer
from shared.errors import ModelNotFound
from shared.gguf_file import GGUFFile
from shared.model_registry import resolve_model

MODELS = ("smollm2-135m", "gemma3-270m")
# Gemma's 262k vocabulary holds common emoji and CJK whole; the rarer ones here
# fall back to <0xNN> byte tokens, as everything non-ASCII does in SmolLM2's BPE.
TEXTS = {
    "emoji": "👋🏽 family 👨\u200d👩\u200d👧 and 🫨🪿🫎!",
    "cjk": "日本語のテキスト 龘靐齉爩",
    "mixed": "Ωμέγα Привет 𠀋𡈽 ok\n",
}


@pytest.fixture(scope="module", params=MODELS)
def tok(request) -> Tokenizer:
    try:
        path = resolve_model(request.param)
    except ModelNotFound as exc:
        pytest.skip(str(exc))
    return Tokenizer.from_metadata(GGUFFile(path).metadata)


def _is_partial(tok: Tokenizer, token_id: int) -> bool:
    try:
        tok.token_bytes(token_id).decode("utf-8")
    except UnicodeDecodeError:
        return True
    return False


@pytest.mark.parametrize("name", TEXTS)
def test_streamed_chunks_are_whole_characters(tok, name):
    text = TEXTS[name]
    ids = tok.encode(text)
    assert any(_is_partial(tok, t) for t in ids), "no token splits a character: the test would prove nothing"
    detok = IncrementalDetokenizer(tok)
    chunks = [detok.feed(t) for t in ids]
    chunks.append(detok.flush())
    for chunk in chunks:
        assert "\ufffd" not in chunk
        chunk.encode("utf-8")  # a lone surrogate or other broken text would raise
    assert "".join(chunks) == tok.decode(ids) == text
    assert any(c == "" for c in chunks[:-1])  # something was held back


def test_special_tokens_skipped_or_rendered(tok):
    text = f"{tok.bos_text}Hi{tok.eos_text}"
    ids = tok.encode(text, parse_special=True)
    detok = IncrementalDetokenizer(tok)
    assert detok.feed_many(ids) + detok.flush() == "Hi"
    detok = IncrementalDetokenizer(tok, skip_special=False)
    assert detok.feed_many(ids) + detok.flush() == text == tok.decode(ids, skip_special=False)


def test_flush_replaces_an_unfinished_character(tok):
    ids = tok.encode("龘")
    first_partial = next(t for t in ids if _is_partial(tok, t))
    detok = IncrementalDetokenizer(tok)
    assert detok.feed(first_partial) == ""
    assert detok.pending_bytes
    assert detok.flush() == "\ufffd"
    assert detok.flush() == ""
