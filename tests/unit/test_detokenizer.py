"""Incremental detokenization: byte-level BPE and SentencePiece-style tokenizers built with `tokenizers`."""

from __future__ import annotations

from typing import Any

import pytest

from engine.core.detokenizer import IncrementalDetokenizer

TEXTS = [
    "Hello world! How are you today?",
    "  leading spaces and trailing  ",
    "Rocket 🚀 and falcon 🦅, café naïve 東京 ÿ",
    "def add(a, b):\n    return a + b\n",
    "🚀🚀🚀",
]


def stream(tokenizer: Any, ids: list[int], skip_special: bool = True) -> list[str]:
    detok = IncrementalDetokenizer(tokenizer, skip_special)
    deltas = [detok.add(t) for t in ids]
    return [*deltas, detok.finish()]


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("kind", ["byte_level_tokenizer", "metaspace_tokenizer"])
def test_concatenated_deltas_equal_full_decode(kind: str, text: str, request: pytest.FixtureRequest) -> None:
    tokenizer = request.getfixturevalue(kind)
    ids = tokenizer.encode(text, add_special_tokens=False)
    deltas = stream(tokenizer, ids)
    assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=True)
    assert all("\ufffd" not in d for d in deltas)  # never a half character


def test_multibyte_character_split_over_byte_tokens(byte_level_tokenizer: Any) -> None:
    ids = byte_level_tokenizer.encode("🚀", add_special_tokens=False)
    assert len(ids) >= 3  # not in the training corpus: split over byte tokens (the prefix F0 9F is shared)
    assert stream(byte_level_tokenizer, ids) == [""] * (len(ids) - 1) + ["🚀", ""]


def test_sentencepiece_spacing_between_pieces(metaspace_tokenizer: Any) -> None:
    ids = metaspace_tokenizer.encode("Hello world fox", add_special_tokens=False)
    deltas = stream(metaspace_tokenizer, ids)
    assert "".join(deltas) == "Hello world fox"
    assert any(d.startswith(" ") for d in deltas[1:])  # the space marker of later pieces survives


def test_special_tokens_skipped_or_kept(byte_level_tokenizer: Any) -> None:
    tok = byte_level_tokenizer
    ids = tok.encode("Hi", add_special_tokens=False) + [tok.eos_token_id]
    assert "".join(stream(tok, ids, skip_special=True)) == "Hi"
    assert "".join(stream(tok, ids, skip_special=False)) == "Hi</s>"
