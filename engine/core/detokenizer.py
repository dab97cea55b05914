"""Incremental detokenization: turn one new token at a time into the text it adds.

Decoding token by token is wrong for byte-level BPE (a character can span tokens) and for SentencePiece
(the leading-space marker is dropped at the start of a decode). So each step decodes a small window that
starts at an already-emitted token, and emits the part past the window's known prefix, holding back text
that still ends in an incomplete UTF-8 sequence (U+FFFD). `finish()` reconciles with one full decode, so the
concatenated deltas always equal `tokenizer.decode(all_ids)`.
"""

from __future__ import annotations

from typing import Any, Protocol

REPLACEMENT_CHAR = "\ufffd"


class Tokenizer(Protocol):
    def decode(self, token_ids: list[int], **kwargs: Any) -> str: ...


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self.token_ids: list[int] = []
        self.text = ""  # everything emitted so far
        self._prefix_offset = 0  # window start: an already-emitted token
        self._read_offset = 0  # tokens before this are reflected in `text`

    def add(self, token_id: int) -> str:
        """Append one token; return the new text it completes (possibly empty)."""
        self.token_ids.append(token_id)
        prefix_text = self._decode(self.token_ids[self._prefix_offset : self._read_offset])
        window_text = self._decode(self.token_ids[self._prefix_offset :])
        if len(window_text) <= len(prefix_text) or window_text.endswith(REPLACEMENT_CHAR):
            return ""
        delta = window_text[len(prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self.token_ids)
        self.text += delta
        return delta

    def finish(self) -> str:
        """Return whatever text the full decode has beyond what was emitted (held-back bytes, cleanups)."""
        full = self._decode(self.token_ids)
        if not full.startswith(self.text):
            return ""  # a tokenizer whose decode is not prefix-stable; never retract emitted text
        delta = full[len(self.text) :]
        self.text = full
        self._prefix_offset = self._read_offset = len(self.token_ids)
        return delta

    def _decode(self, ids: list[int]) -> str:
        if not ids:
            return ""
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special)
