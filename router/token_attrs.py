"""Token attribute bit flags, as llama.cpp's llama_token_attr, and GGUF token types."""
from __future__ import annotations

from typing import Sequence

UNDEFINED = 0
UNKNOWN = 1 << 0
UNUSED = 1 << 1
NORMAL = 1 << 2
CONTROL = 1 << 3
USER_DEFINED = 1 << 4
BYTE = 1 << 5

# tokenizer.ggml.token_type values (llama_token_type)
_FROM_GGUF_TYPE = {1: NORMAL, 2: UNKNOWN, 3: CONTROL, 4: USER_DEFINED, 5: UNUSED, 6: BYTE}


def attrs_from_token_types(token_types: Sequence[int] | None, n_tokens: int) -> list[int]:
    if token_types is None:
        return [NORMAL] * n_tokens
    if len(token_types) < n_tokens:
        raise ValueError(f"tokenizer.ggml.token_type has {len(token_types)} entries for {n_tokens} tokens")
    get = _FROM_GGUF_TYPE.get
    return [get(t, UNDEFINED) for t in token_types[:n_tokens]]
