"""Tokenization of GGUF vocabularies, reproducing llama.cpp's llama_tokenize exactly.

llama.cpp (src/llama-vocab.cpp) tokenizes in two stages, and so does this module:

1. Partition (tokenizer_st_partition): special tokens are cut out of the raw
   text, longest token text first, every occurrence left to right. Control and
   unknown tokens take part only with parse_special; user-defined tokens (Gemma's
   runs of spaces, tabs and newlines) always do.
2. The text between them goes to the vocabulary's engine (router.vocab_backends):
   HF `tokenizers` byte-level BPE for 'gpt2' vocabularies, `sentencepiece` for
   'llama' (SPM) vocabularies.

Special token ids, add_bos/add_eos and the end-of-generation set follow
llama_vocab::impl::load, including its detection of special tokens by text.
"""
from __future__ import annotations

import bisect
from typing import Any, Iterable, Mapping

from router import vocab_backends
from router.token_attrs import BYTE, CONTROL, NORMAL, UNKNOWN, USER_DEFINED, attrs_from_token_types

_PREFIX = "tokenizer.ggml."

# llama_vocab::impl::load: texts that mark end-of-turn, end-of-message, fill-in-the-middle
# and end-of-generation tokens when the GGUF does not name them
_EOT_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>",
              "<|end_of_text|>", "<EOT>", "_<EOT>", "[EOT]", "<｜end▁of▁sentence｜>",
              "<end_of_utterance>")
_EOM_TEXTS = ("<|eom_id|>",)
_FIM_TEXTS = {
    "fim_pre": ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>",
                "▁<PRE>", "<|code_prefix|>", "<|prefix|>"),
    "fim_suf": ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>", "<SUF>",
                "▁<SUF>", "<|code_suffix|>", "<|suffix|>"),
    "fim_mid": ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>",
                "▁<MID>", "<|code_middle|>", "<|middle|>"),
    "fim_pad": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
    "fim_rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "fim_sep": ("<|file_sep|>",),
}
_EOG_TEXTS = frozenset({
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
    "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
    "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
    "<｜end▁of▁sentence｜>", "[e~[",
})
_ALWAYS_RENDERED = ("<|channel|>", "<|message|>", "<|start|>", "<|constrain|>")  # gpt-oss

# metadata key (without "tokenizer.ggml.") for each special id; later entries of the
# same name are llama.cpp's deprecated spellings
_ID_KEYS = (
    ("bos", "bos_token_id"), ("eos", "eos_token_id"), ("eot", "eot_token_id"),
    ("eom", "eom_token_id"), ("unk", "unknown_token_id"), ("sep", "seperator_token_id"),
    ("pad", "padding_token_id"), ("mask", "mask_token_id"),
    ("fim_pre", "fim_pre_token_id"), ("fim_suf", "fim_suf_token_id"),
    ("fim_mid", "fim_mid_token_id"), ("fim_pad", "fim_pad_token_id"),
    ("fim_rep", "fim_rep_token_id"), ("fim_sep", "fim_sep_token_id"),
    ("fim_pre", "prefix_token_id"), ("fim_suf", "suffix_token_id"), ("fim_mid", "middle_token_id"),
)


def _gpt2_unicode_to_byte() -> dict[str, int]:
    """Inverse of GPT-2's bytes_to_unicode: the printable stand-in character of every byte."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {chr(b): b for b in printable}
    extra = 0
    for b in range(256):
        if b not in printable:
            table[chr(256 + extra)] = b
            extra += 1
    return table


_GPT2_BYTES = _gpt2_unicode_to_byte()


class _SpecialMatcher:
    """llama.cpp's tokenizer_st_partition over one set of special tokens."""

    def __init__(self, tokens: list[str], ids: list[int]):
        self._tokens = tokens
        self._ids = {tokens[i]: i for i in ids}
        # llama.cpp sorts by byte length, longest first (ties: unspecified; here by id)
        self._rank = {i: r for r, i in enumerate(sorted(ids, key=lambda i: (-len(tokens[i].encode()), i)))}
        # `head in text` rules out whole groups (Gemma's 6000 "<unused...>") at C speed
        groups: dict[str, list[str]] = {}
        for text in self._ids:
            groups.setdefault(text[:4], []).append(text)
        self._groups = list(groups.items())

    def partition(self, text: str) -> list[str | int]:
        """The text as raw-text pieces and special token ids, in order."""
        if not self._ids:
            return [text]
        found = [t for head, group in self._groups if head in text for t in group if t in text]
        if not found:
            return [text]
        # llama.cpp splits every remaining raw fragment at each occurrence of one
        # token, then moves on to the next token. The same result, as claimed
        # intervals: an occurrence is taken if it lies in unclaimed text and does
        # not overlap the previous occurrence taken for the same token.
        starts: list[int] = []
        claimed: list[tuple[int, int, int]] = []
        for tid in sorted((self._ids[t] for t in found), key=self._rank.__getitem__):
            special = self._tokens[tid]
            size = len(special)
            pos = text.find(special)
            while pos >= 0:
                end = pos + size
                k = bisect.bisect_left(starts, end)
                if k == 0 or claimed[k - 1][1] <= pos:
                    starts.insert(k, pos)
                    claimed.insert(k, (pos, end, tid))
                    pos = text.find(special, end)
                else:  # every start before that claim's end overlaps it too
                    pos = text.find(special, claimed[k - 1][1])
        fragments: list[str | int] = []
        prev = 0
        for pos, end, tid in claimed:
            if pos > prev:
                fragments.append(text[prev:pos])
            fragments.append(tid)
            prev = end
        if prev < len(text):
            fragments.append(text[prev:])
        return fragments


class Tokenizer:
    """A GGUF vocabulary: encode like llama_tokenize, decode like llama_token_to_piece."""

    def __init__(self, metadata: Mapping[str, Any]):
        md = metadata
        self.model: str = str(md.get(_PREFIX + "model", ""))
        self.pre: str = str(md.get(_PREFIX + "pre", "") or "default")
        tokens = md.get(_PREFIX + "tokens")
        if not tokens:
            raise ValueError("GGUF has no tokenizer.ggml.tokens: this model has no vocabulary to tokenize with")
        if self.model not in ("gpt2", "llama"):
            raise ValueError(f"unsupported tokenizer model {self.model!r} (tokenizer.ggml.model); "
                             "supported: 'gpt2' (byte-level BPE) and 'llama' (SentencePiece)")
        self._tokens: list[str] = [t if t else f"[EMPTY_{i}]" for i, t in enumerate(tokens)]
        n = self.vocab_size = len(self._tokens)
        self._attrs = attrs_from_token_types(md.get(_PREFIX + "token_type"), n)
        self._text_to_id = {t: i for i, t in enumerate(self._tokens)}
        is_spm = self.model == "llama"

        ids: dict[str, int | None] = dict.fromkeys({name for name, _ in _ID_KEYS})
        # llama.cpp's defaults when the GGUF names no id
        if is_spm:
            ids.update(bos=1, eos=2, unk=0)
        else:
            ids.update(bos=11, eos=11)
        for name in ("bos", "eos", "unk"):
            if ids[name] is not None and ids[name] >= n:
                ids[name] = None
        for name, key in _ID_KEYS:
            value = md.get(_PREFIX + key)
            if value is not None and 0 <= int(value) < n:
                ids[name] = int(value)

        self.add_space_prefix = bool(md.get(_PREFIX + "add_space_prefix", is_spm))
        self.add_bos = bool(md.get(_PREFIX + "add_bos_token", is_spm or self.pre in vocab_backends.LLAMA3_STYLE_PRE))
        self.add_eos = bool(md.get(_PREFIX + "add_eos_token", False))
        if self.add_bos and ids["bos"] is None:
            raise ValueError("tokenizer.ggml.add_bos_token is true, but the GGUF has no valid bos_token_id")
        if self.add_eos and ids["eos"] is None:
            raise ValueError("tokenizer.ggml.add_eos_token is true, but the GGUF has no valid eos_token_id")

        self._detect_by_text(ids, "eot", _EOT_TEXTS)
        self._detect_by_text(ids, "eom", _EOM_TEXTS)
        for name, texts in _FIM_TEXTS.items():
            self._detect_by_text(ids, name, texts)
        self._ids = ids
        self.eos_ids: frozenset[int] = self._end_of_generation_ids(ids)
        for text in _ALWAYS_RENDERED:
            if text in self._text_to_id:
                self._attrs[self._text_to_id[text]] = USER_DEFINED

        special = [i for i, a in enumerate(self._attrs) if a & (CONTROL | USER_DEFINED | UNKNOWN)]
        self._match_all = _SpecialMatcher(self._tokens, special)
        self._match_user = _SpecialMatcher(self._tokens, [i for i in special
                                                          if not self._attrs[i] & (CONTROL | UNKNOWN)])
        if is_spm:
            self._encode_text = vocab_backends.build_spm_encoder(
                self._tokens, md.get(_PREFIX + "scores"), self._attrs, ids["unk"])
        else:
            merges = md.get(_PREFIX + "merges")
            if merges is None:
                raise ValueError("GGUF has a 'gpt2' vocabulary but no tokenizer.ggml.merges")
            self._encode_text = vocab_backends.build_bpe_encoder(self._tokens, merges, self.pre)
        self._piece_cache: list[bytes | None] = [None] * n

    @classmethod
    def from_metadata(cls, metadata: Mapping[str, Any]) -> "Tokenizer":
        return cls(metadata)

    def _detect_by_text(self, ids: dict[str, int | None], name: str, texts: Iterable[str]) -> None:
        if ids[name] is not None:
            return
        found = [self._text_to_id[t] for t in texts if t in self._text_to_id]
        if found:
            ids[name] = min(found)
            self._attrs[ids[name]] |= CONTROL

    def _end_of_generation_ids(self, ids: dict[str, int | None]) -> frozenset[int]:
        eog = {ids[k] for k in ("fim_pad", "fim_rep", "fim_sep") if ids[k] is not None}
        for text in _EOG_TEXTS:
            tid = self._text_to_id.get(text)
            if tid is not None:
                eog.add(tid)
                self._attrs[tid] |= CONTROL
        eog.update(ids[k] for k in ("eos", "eot", "eom") if ids[k] is not None)
        texts = {self._tokens[i]: i for i in eog}
        # o200k_harmony / solar-open: "<|end|>" ends a message, not the generation
        if "<|end|>" in texts and (("<|return|>" in texts and ("<|call|>" in texts or "<|calls|>" in texts))
                                   or ("<|calls|>" in texts and "<|flush|>" in texts)
                                   or ("<|call|>" in texts and "<|flush|>" in texts)):
            eog.discard(texts["<|end|>"])
            self._attrs[texts["<|end|>"]] = USER_DEFINED
        # gemma4: "</s>" is an ordinary token there
        if "<|tool_response>" in texts and "</s>" in texts:
            eog.discard(texts["</s>"])
            self._attrs[texts["</s>"]] = NORMAL
        return frozenset(eog)

    # ---- special ids -------------------------------------------------------------------

    @property
    def bos_id(self) -> int | None:
        return self._ids["bos"]

    @property
    def eos_id(self) -> int | None:
        return self._ids["eos"]

    @property
    def pad_id(self) -> int | None:
        return self._ids["pad"]

    @property
    def mask_id(self) -> int | None:
        return self._ids["mask"]

    @property
    def bos_text(self) -> str | None:
        return None if self.bos_id is None else self._tokens[self.bos_id]

    @property
    def eos_text(self) -> str | None:
        return None if self.eos_id is None else self._tokens[self.eos_id]

    def token_text(self, token_id: int) -> str:
        """The token's entry in the GGUF vocabulary, unconverted (e.g. 'Ġthe', '▁the', '<0x0A>')."""
        return self._tokens[self._check(token_id)]

    def token_id(self, text: str) -> int | None:
        """The id whose vocabulary entry is exactly `text`, if any."""
        return self._text_to_id.get(text)

    def is_special(self, token_id: int) -> bool:
        """Control and unknown tokens: the ones decode(skip_special=True) leaves out."""
        return bool(self._attrs[self._check(token_id)] & (CONTROL | UNKNOWN))

    def is_eog(self, token_id: int) -> bool:
        return token_id in self.eos_ids

    # ---- encode / decode ---------------------------------------------------------------

    def encode(self, text: str, add_special: bool = False, parse_special: bool = False) -> list[int]:
        """llama_tokenize(text, add_special, parse_special)."""
        out: list[int] = []
        if add_special and self.add_bos:
            out.append(self._ids["bos"])  # type: ignore[arg-type]
        fragments = (self._match_all if parse_special else self._match_user).partition(text) if text else []
        prefix_space = self.model == "llama" and self.add_space_prefix
        prev_special = True
        for frag in fragments:
            if isinstance(frag, int):
                out.append(frag)
                prev_special = True
            else:
                out.extend(self._encode_text(" " + frag if prefix_space and prev_special else frag))
                prev_special = False
        if add_special and self.add_eos:
            out.append(self._ids["eos"])  # type: ignore[arg-type]
        return out

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes a token stands for, special tokens as their text (llama_token_to_piece, special=True)."""
        piece = self._piece_cache[self._check(token_id)]
        if piece is None:
            piece = self._piece_cache[token_id] = self._compute_piece(token_id)
        return piece

    def _compute_piece(self, token_id: int) -> bytes:
        text, attr = self._tokens[token_id], self._attrs[token_id]
        if attr & (CONTROL | UNKNOWN | USER_DEFINED):
            return text.encode()
        if attr & NORMAL:
            if self.model == "llama":
                return text.replace("\u2581", " ").encode()
            table = _GPT2_BYTES
            return b"".join(bytes((table[ch],)) if ch in table else ch.encode() for ch in text)
        if attr & BYTE:
            return bytes((int(text[3:5], 16),))
        return b""  # unused / undefined tokens have no text, as in llama.cpp

    def decode(self, ids: Iterable[int], skip_special: bool = True) -> str:
        """The text of `ids`; with skip_special, control and unknown tokens are left out.

        Like llama.cpp's streaming (token_to_piece per token) this strips no leading
        space and applies no clean-up of spaces, so it equals the concatenation of
        what IncrementalDetokenizer emits. Invalid UTF-8 becomes U+FFFD.
        """
        return self.decode_bytes(ids, skip_special).decode("utf-8", errors="replace")

    def decode_bytes(self, ids: Iterable[int], skip_special: bool = True) -> bytes:
        parts = []
        for tid in ids:
            if skip_special and self._attrs[self._check(tid)] & (CONTROL | UNKNOWN):
                continue
            parts.append(self.token_bytes(tid))
        return b"".join(parts)

    def _check(self, token_id: int) -> int:
        if not 0 <= token_id < self.vocab_size:
            raise ValueError(f"token id {token_id} is outside the vocabulary (0..{self.vocab_size - 1})")
        return token_id

    def __repr__(self) -> str:
        return (f"Tokenizer(model={self.model!r}, pre={self.pre!r}, vocab_size={self.vocab_size}, "
                f"bos={self.bos_id}, eos={self.eos_id}, eog={sorted(self.eos_ids)})")

