"""The tokenizer a served GGUF gets (models/loader.load_tokenizer) gives up the Python vocabulary and merges that
transformers' Qwen2 / Gemma / Llama / GPT-2 tokenizers keep after building their Rust tokenizer from them
(`drop_build_lists`: 63 MiB resident for Qwen's 151,936 tokens, 95 MiB for Gemma 3's 262,144), and tokenizes,
decodes, lists its vocabulary and saves exactly as the tokenizer that keeps them. Real vocabularies: Qwen2's
(llama.cpp's vocab-only GGUF, in a Qwen3 file) and a SentencePiece one (Llama 2's, in a Gemma 3 file)."""

from __future__ import annotations

import filecmp
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from models import gguf_weights
from models.loader import load_tokenizer
from tests.api.test_family_tools import write_model

pytestmark = pytest.mark.timeout(900)
TEXTS = ["Hello world", "  indented\n\tcode(x) -> 12345", "ünïcödé 日本語 🙂", "<|im_start|>user\nhi<|im_end|>",
         "<start_of_turn>model\n"]


@pytest.mark.parametrize(("family", "cls"), [("qwen3", "Qwen2Tokenizer"), ("gemma3", "GemmaTokenizer")])
def test_the_served_tokenizer_drops_the_build_lists_and_answers_the_same(family: str, cls: str,
                                                                         tmp_path: Path) -> None:
    folder = gguf_weights.metadata_folder(write_model(family), tmp_path / "cache")
    kept, served = AutoTokenizer.from_pretrained(folder), load_tokenizer(folder)
    assert type(served).__name__ == cls
    assert len(kept._vocab) > 30_000 and len(kept._merges) > 30_000  # what transformers keeps
    assert served._vocab == {} and served._merges == []
    assert len(served) == len(kept) and served.get_vocab() == kept.get_vocab()
    for text in TEXTS:
        ids = kept.encode(text)
        assert served.encode(text) == ids, text
        assert served.decode(ids) == kept.decode(ids)
        assert served.convert_ids_to_tokens(ids) == kept.convert_ids_to_tokens(ids)
    kept.save_pretrained(tmp_path / "kept")
    served.save_pretrained(tmp_path / "served")
    assert filecmp.cmp(tmp_path / "kept" / "tokenizer.json", tmp_path / "served" / "tokenizer.json", shallow=False)
