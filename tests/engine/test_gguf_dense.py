"""A GGUF with no quantized tensor (an F16 or a BF16 file, as llama.cpp's converter writes one before quantizing) is
served as it is on the CPU: each tensor read from the file into the serving dtype, nothing converted to disk, no
quantized model for `--weight-format auto` to time dense copies against. `--dtype auto` serves a BF16 file in
bfloat16 (its own type, no float32 copy) and times an F16 one in float32 and bfloat16 as a dense folder is. The
preflight counts the weights in that dtype. The tiny models are tests/family_gguf.py's (random weights, F16 / BF16
matmul weights, F32 norms); the reference is transformers' model on the values the file holds.

Stated bound: in float32 the fast path's logits are within 1e-4 of the reference's largest logit (the same weights,
float32 arithmetic in another order; measured 4e-7 on Llama 3's tiny model, 6e-7 on Qwen3's, AMD EPYC Zen 4), and the
greedy tokens are transformers'; in bfloat16 (weights as the file holds them, activations rounded to bfloat16) within
5% (measured 1.0%)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from engine.model.quant import QuantLinear
from engine.types import EngineConfig
from models import gguf_weights, preflight
from models.loader import gguf_cache_folder, load_model
from tests.engine.test_families import PROMPT, against_transformers, vocab_of
from tests.family_gguf import write_family
from tests.support import Loaded, make_engine

pytestmark = pytest.mark.timeout(900)


def test_held_dtype_is_the_files_own_type_when_nothing_is_quantized() -> None:
    f32, f16, bf16, q8 = 0, 1, 30, 8
    assert gguf_weights.held_dtype({"a": bf16, "norm": f32}) == "bfloat16"
    assert gguf_weights.held_dtype({"a": f16, "norm": f32}) == "float16"
    assert gguf_weights.held_dtype({"a": f32}) == "float32"
    assert gguf_weights.held_dtype({"a": q8, "norm": f32}) is None  # kept quantized: the other loader
    assert gguf_weights.held_dtype({"a": 99}) is None and gguf_weights.held_dtype({}) is None


def written(folder: Path, family: str, matmul: str, tokenizer: object) -> tuple[Path, torch.nn.Module]:
    folder.mkdir()
    reference = write_family(folder, family, vocab_of(tokenizer), tokenizer=tokenizer, matmul=matmul)
    (folder / "config.json").unlink()  # a bare file, as users download it: its metadata is converted
    return folder / "tiny.gguf", reference


def config(path: Path, cache: Path, dtype: str, weight_format: str = "auto") -> EngineConfig:
    return EngineConfig(model_path=str(path.parent), model_name="t", gguf_file=path.name, device="cpu", dtype=dtype,
                        weight_format=weight_format, cache_dir=str(cache), max_model_len=256)


def test_a_bf16_file_is_served_in_bfloat16_as_it_is(tmp_path: Path, byte_level_tokenizer: object,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    path, reference = written(tmp_path / "file", "qwen3", "BF16", byte_level_tokenizer)
    assert gguf_weights.held_dtype(preflight.read_gguf_layout(path).types) == "bfloat16"
    with caplog.at_level(logging.INFO):
        loaded = load_model(config(path, tmp_path / "cache", "auto"))
    assert loaded.dtype == torch.bfloat16 and "the file's own type" in caplog.text
    assert "BF16 weights read as the file holds them into bfloat16" in caplog.text
    assert "weight format auto" not in caplog.text and "dtype auto: bfloat16, timed" not in caplog.text  # no probe
    linears = [m for m in loaded.model.modules() if isinstance(m, torch.nn.Linear)]
    assert linears and not any(isinstance(m, QuantLinear) for m in loaded.model.modules())
    assert all(m.weight.dtype == torch.bfloat16 for m in linears)
    # the weights are the file's values, bit for bit (BF16 -> bfloat16 is no conversion)
    q = loaded.model.model.layers[0].self_attn.q_proj.weight
    assert torch.equal(q.float(), reference.model.layers[0].self_attn.q_proj.weight)
    assert not gguf_cache_folder(path, tmp_path / "cache").exists()  # nothing converted to disk
    error, _, _ = against_transformers(make_engine(Loaded(loaded.model, byte_level_tokenizer, 256)), reference,
                                       PROMPT)
    assert error <= 0.05, f"logit error {error:.3g} of the largest logit"


@pytest.mark.parametrize("family", ["llama3", "qwen3"])
def test_an_f16_file_in_float32_matches_transformers(family: str, tmp_path: Path, byte_level_tokenizer: object) -> None:
    path, reference = written(tmp_path / "file", family, "F16", byte_level_tokenizer)
    loaded = load_model(config(path, tmp_path / "cache", "float32", weight_format="quantized"))
    assert loaded.dtype == torch.float32 and not any(isinstance(m, QuantLinear) for m in loaded.model.modules())
    assert not gguf_cache_folder(path, tmp_path / "cache").exists()
    error, ours, theirs = against_transformers(make_engine(Loaded(loaded.model, byte_level_tokenizer, 256)),
                                               reference, PROMPT)
    assert error <= 1e-4, f"{family}: logit error {error:.3g} of the largest logit"
    assert ours == theirs


def test_an_f16_file_under_dtype_auto_is_timed_like_a_dense_folder(tmp_path: Path, byte_level_tokenizer: object,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    path, _ = written(tmp_path / "file", "qwen3", "F16", byte_level_tokenizer)
    with caplog.at_level(logging.INFO):
        loaded = load_model(config(path, tmp_path / "cache", "auto"))
    assert "F16 weights read as the file holds them into float32" in caplog.text
    assert "dtype auto: " in caplog.text and "weight format auto" not in caplog.text
    assert loaded.dtype in (torch.float32, torch.bfloat16)
    assert all(m.weight.dtype == loaded.dtype for m in loaded.model.modules() if isinstance(m, torch.nn.Linear))


def test_the_preflight_counts_a_bf16_file_in_bfloat16_without_dense_copies(
        tmp_path: Path, byte_level_tokenizer: object, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    from config import load_settings
    from models.acquire import acquire

    path, _ = written(tmp_path / "file", "qwen3", "BF16", byte_level_tokenizer)
    monkeypatch.chdir(tmp_path)  # no .env
    settings = load_settings(["--model", str(path), "--device", "cpu", "--embedding-model", "none",
                              "--cache-dir", str(tmp_path / "cache"), "--max-model-len", "256"])
    with caplog.at_level(logging.INFO):
        acquire(settings)
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("preflight: needs"))
    assert "in bfloat16" in line and "copy timed" not in line, line


def test_several_models_count_a_bf16_file_in_bfloat16(tmp_path: Path, byte_level_tokenizer: object) -> None:
    """The multi-model registry's memory need (serving/start.py model_spec) counts the dtype the loader will serve."""
    from models.acquire import Prepared, counted_dtype

    bf16, _ = written(tmp_path / "bf16", "qwen3", "BF16", byte_level_tokenizer)
    f16, _ = written(tmp_path / "f16", "qwen3", "F16", byte_level_tokenizer)

    def prepared(path: Path, dtype: str, device: str = "cpu") -> Prepared:
        return Prepared(path, device, dtype, config(path, tmp_path / "cache", dtype))

    assert counted_dtype(prepared(bf16, "auto")) == "bfloat16"
    assert counted_dtype(prepared(bf16, "float32")) == "float32"  # asked for: served so
    assert counted_dtype(prepared(f16, "auto")) == "auto"  # timed in float32 and bfloat16
    assert counted_dtype(prepared(bf16, "auto", device="cuda:0")) == "auto"  # converted there


def test_several_models_count_a_quantized_file_by_its_bytes(tmp_path: Path, byte_level_tokenizer: object) -> None:
    """A GGUF kept quantized on the CPU needs its tensors' bytes, not float32 copies of its parameters."""
    from models import memory
    from models.acquire import Prepared, local_footprint

    path, _ = written(tmp_path / "q8", "qwen3", "Q8_0", byte_level_tokenizer)

    def need(weight_format: str) -> int:
        prepared = Prepared(path, "cpu", "auto", config(path, tmp_path / "cache", "auto", weight_format))
        return memory.serving_size(local_footprint(prepared, "t"), "auto", kv_dtype="auto", max_model_len=256,
                                   kv_cache_bytes=1 << 20, packed_copy=False).need_bytes

    tensors = preflight.gguf_footprint(path, cached=True, quantized=True).weight_bytes
    assert need("auto") == need("quantized") == tensors + (1 << 20)
    assert need("dense") > 2 * need("auto")  # converted: float32 weights and the bfloat16 copy the probe times


def test_quantize_int8_takes_a_bf16_file_read_as_it_is(tmp_path: Path, byte_level_tokenizer: object) -> None:
    import dataclasses

    path, _ = written(tmp_path / "file", "qwen3", "BF16", byte_level_tokenizer)
    loaded = load_model(dataclasses.replace(config(path, tmp_path / "cache", "auto"), quantize="int8"))
    assert loaded.dtype == torch.float32  # activations, as for a quantized file
    assert any(isinstance(m, QuantLinear) for m in loaded.model.modules())
    assert not gguf_cache_folder(path, tmp_path / "cache").exists()
