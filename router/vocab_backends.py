"""The two tokenization engines behind router.tokenizer.Tokenizer.

Both are built in memory from GGUF metadata, never from files:

* GPT-2 style byte-level BPE (tokenizer.ggml.model 'gpt2'): an HF `tokenizers`
  BPE model over the GGUF's tokens and merges, pre-tokenized with llama.cpp's
  regexes for the vocabulary's pre-tokenizer type (src/llama-vocab.cpp,
  llm_tokenizer_bpe).
* SentencePiece style (tokenizer.ggml.model 'llama'): a `sentencepiece` BPE
  model built from the tokens, scores and token types. llama.cpp's SPM
  tokenizer merges adjacent symbols by highest score (ties: leftmost) and
  falls back to <0xNN> byte tokens, which is exactly sentencepiece's BPE
  encoder with byte fallback.

Special and user-defined tokens are split out by the caller before text
reaches either engine, so neither engine knows about them.
"""
from __future__ import annotations

from typing import Callable, Sequence

from router.token_attrs import BYTE, USER_DEFINED

Encoder = Callable[[str], list[int]]

# llama.cpp's pre-tokenizer regexes (src/llama-vocab.cpp, llm_tokenizer_bpe).
# llama.cpp runs GPT2 through a hand-written matcher that also takes the
# trailing `|\s+` alternative, so it is spelled out here.
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
          r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_DEFAULT = [r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"]

_PRE_REGEXES: dict[str, list[str]] = {}
for _names, _regexes in (
    (("default", ""), _DEFAULT),
    (("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b"),
     [r"\p{N}", _GPT2]),
    (("gpt-2", "gpt2", "phi-2", "mpt", "olmo", "jais", "exaone4", "jina-es", "jina-de",
      "jina-v1-en", "jina-v2-es", "jina-v2-de", "jina-v2-code", "roberta-bpe", "gigachat",
      "mellum", "modern-bert", "trillion", "granite-docling", "a.x-4.0"), [_GPT2]),
    (("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
      "dbrx", "smaug-bpe"), [_LLAMA3]),
    (("qwen2", "deepseek-r1-qwen", "stablelm2", "megrez", "hunyuan"), [_QWEN2]),
):
    for _name in _names:
        _PRE_REGEXES[_name] = _regexes

# pre-tokenizers for which llama.cpp looks a whole pre-token up in the vocabulary
# before merging (llama_vocab ignore_merges) and adds BOS unless the GGUF says otherwise
LLAMA3_STYLE_PRE = frozenset({"llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral",
                              "midm-2.0", "lfm2"})


def supported_pre_tokenizers() -> list[str]:
    return sorted(n for n in _PRE_REGEXES if n)


def _split_merge(merge: str) -> tuple[str, str] | None:
    # llama.cpp splits at the first space after position 0, so a merge may start with one
    pos = merge.find(" ", 1)
    if pos < 0:
        return None
    return merge[:pos], merge[pos + 1:]


def build_bpe_encoder(tokens: Sequence[str], merges: Sequence[str], pre: str) -> Encoder:
    """Byte-level BPE over the GGUF vocabulary, pre-tokenized like llama.cpp does for `pre`."""
    from tokenizers import Regex, pre_tokenizers
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers.models import BPE

    if pre not in _PRE_REGEXES:
        raise ValueError(f"unsupported BPE pre-tokenizer {pre!r} (tokenizer.ggml.pre); supported: "
                         f"{', '.join(supported_pre_tokenizers())}")
    vocab = {text: i for i, text in enumerate(tokens)}
    pairs = []
    for merge in merges:
        pair = _split_merge(merge)
        # HF refuses merges whose parts or result are not tokens; llama.cpp would
        # merge them and then emit the result byte by byte, which never helps.
        if pair and pair[0] in vocab and pair[1] in vocab and pair[0] + pair[1] in vocab:
            pairs.append(pair)
    model = BPE(vocab=vocab, merges=pairs, ignore_merges=pre in LLAMA3_STYLE_PRE)
    hf = HFTokenizer(model)
    hf.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(rx), behavior="isolated") for rx in _PRE_REGEXES[pre]]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])

    def encode(text: str) -> list[int]:
        return hf.encode(text, add_special_tokens=False).ids

    return encode


def build_spm_encoder(tokens: Sequence[str], scores: Sequence[float] | None,
                      attrs: Sequence[int], unk_id: int | None) -> Encoder:
    """SentencePiece BPE (merge by score, byte fallback) over the GGUF vocabulary.

    The caller escapes nothing: sentencepiece turns ' ' into '\u2581' itself.
    """
    import sentencepiece as spm
    try:
        from sentencepiece import sentencepiece_model_pb2 as pb
    except Exception as exc:  # protobuf missing, or older than the gencode sentencepiece ships
        raise ImportError("building a SentencePiece vocabulary needs protobuf matching sentencepiece's "
                          f"sentencepiece_model_pb2 (pip install 'protobuf>=7.36.1'): {exc}") from exc

    piece_type = pb.ModelProto.SentencePiece.Type
    normal, unknown, user_defined, byte = (piece_type.NORMAL, piece_type.UNKNOWN,
                                           piece_type.USER_DEFINED, piece_type.BYTE)
    model = pb.ModelProto()
    add = model.pieces.add
    n = len(tokens)
    if scores is None:
        scores = [0.0] * n
    # llama.cpp merges into any vocabulary entry, control and unused ones
    # included, so those are NORMAL here; sentencepiece would otherwise keep
    # them out of merges.
    for i, (text, score, attr) in enumerate(zip(tokens, scores, attrs)):
        if i == unk_id:
            kind = unknown
        elif attr & BYTE:
            kind = byte
        elif attr & USER_DEFINED:
            kind = user_defined
        else:
            kind = normal
        add(piece=text, score=score, type=kind)
    extra_unk = unk_id is None or not 0 <= unk_id < n
    if extra_unk:  # sentencepiece insists on an unknown piece; this one is never emitted
        add(piece="\u2581<tensorserve-unk>\u2581", score=0.0, type=unknown)
    trainer = model.trainer_spec
    trainer.model_type = pb.TrainerSpec.BPE
    trainer.vocab_size = len(model.pieces)
    trainer.unk_id = n if extra_unk else unk_id
    trainer.bos_id = trainer.eos_id = trainer.pad_id = -1
    trainer.byte_fallback = sum(1 for a in attrs if a & BYTE) >= 256
    norm = model.normalizer_spec
    norm.name = "identity"
    norm.add_dummy_prefix = False
    norm.remove_extra_whitespaces = False
    norm.escape_whitespaces = True
    sp = spm.SentencePieceProcessor(model_proto=model.SerializeToString())

    if not extra_unk:
        return sp.encode

    def encode(text: str) -> list[int]:
        return [i for i in sp.encode(text) if i != n]

    return encode
