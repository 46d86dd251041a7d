"""Streaming detokenization: token ids in, complete UTF-8 text out.

A byte-level BPE or byte-fallback token can end in the middle of a character
(an emoji is often three or four tokens). The incremental UTF-8 decoder holds
such a tail back until the token that completes it arrives, so a chunk never
carries half a character or a premature U+FFFD.
"""
from __future__ import annotations

import codecs

from router.tokenizer import Tokenizer


class IncrementalDetokenizer:
    """Feed generated ids one at a time; concatenated output equals tokenizer.decode(all ids)."""

    def __init__(self, tokenizer: Tokenizer, skip_special: bool = True):
        self._tokenizer = tokenizer
        self._skip_special = skip_special
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, token_id: int) -> str:
        """The text completed by this token ('' while a character is still incomplete)."""
        if self._skip_special and self._tokenizer.is_special(token_id):
            return ""
        return self._decoder.decode(self._tokenizer.token_bytes(token_id))

    def feed_many(self, token_ids: list[int]) -> str:
        return "".join(self.feed(t) for t in token_ids)

    def flush(self) -> str:
        """Whatever is held back; bytes that never formed a character come out as U+FFFD."""
        return self._decoder.decode(b"", final=True)

    @property
    def pending_bytes(self) -> bytes:
        """The incomplete UTF-8 tail held back so far."""
        return self._decoder.getstate()[0]
