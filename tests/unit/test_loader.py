"""models/loader.py and engine/backends/devices.py (with the probes of engine/backends/cpu.py, cuda.py, tt.py): device and dtype choice, folder loading, the GGUF conversion cache.

The fast tests use the tiny random Llama from tests/conftest.py and small files made here; the slow one
converts the bundled SmolLM2 GGUF for real into a fresh cache and checks it is faithful and reused.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from engine.backends import devices, tt
from engine.backends.devices import DeviceError
from engine.types import EngineConfig
from models import loader
from models.loader import LoadError

# --- devices ----------------------------------------------------------------------------------------------


def test_cpu_and_auto_resolve_to_cpu_here() -> None:
    assert devices.resolve_device("cpu") == torch.device("cpu")
    if not torch.cuda.is_available():
        assert devices.resolve_device("auto") == torch.device("cpu")


@pytest.mark.parametrize("name", ["gpu", "cpu:0", "cuda:x", "tt:1", ""])
def test_unknown_device_names(name: str) -> None:
    with pytest.raises(DeviceError, match="unknown device"):
        devices.resolve_device(name)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_cuda_missing_says_why() -> None:
    with pytest.raises(
        DeviceError, match=r"device 'cuda:0' cannot be used: .*(CPU-only build|no CUDA device)"
    ):
        devices.resolve_device("cuda:0")


def test_tt_missing_names_the_missing_piece(monkeypatch: pytest.MonkeyPatch) -> None:
    present: set[str] = set()
    monkeypatch.setattr(
        tt.importlib.util, "find_spec", lambda name: object() if name in present else None
    )
    with pytest.raises(DeviceError, match="the torch_ttnn package is not installed"):
        devices.resolve_device("tt")
    present.add("torch_ttnn")
    with pytest.raises(DeviceError, match="the ttnn package is not installed"):
        devices.resolve_device("tt")
    present.add("ttnn")
    monkeypatch.setattr(tt, "tt_device_count", lambda: 0)
    with pytest.raises(DeviceError, match="no Tenstorrent device found"):
        devices.resolve_device("tt")
    monkeypatch.setattr(tt, "tt_device_count", lambda: 1)
    probe, device = devices.resolve_probe("tt")
    assert probe.name == "tt" and device == torch.device("cpu")  # host tensors; the card runs compiled graphs


def test_auto_prefers_cuda_then_tt_then_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    available = {"cuda": False, "tt": True}
    for name in available:
        monkeypatch.setattr(
            devices.PROBES[name], "missing", lambda n=name: None if available[n] else "absent"
        )
    monkeypatch.setattr(devices.PROBES["tt"], "torch_device", lambda index: torch.device("cpu"))
    assert devices.resolve_probe("auto")[0].name == "tt"
    available["tt"] = False
    assert devices.resolve_probe("auto")[0].name == "cpu"


def test_explicit_dtypes() -> None:
    cpu = torch.device("cpu")
    assert devices.resolve_dtype("float32", cpu) is torch.float32
    assert devices.resolve_dtype("bfloat16", cpu) is torch.bfloat16
    assert devices.resolve_dtype("float16", cpu) is torch.float16
    with pytest.raises(DeviceError, match="unknown dtype"):
        devices.resolve_dtype("int4", cpu)


def test_auto_dtype_on_cpu_is_left_to_the_loaded_model() -> None:
    """The CPU's choice is made by timing decode steps once the model is loaded (models/autotune/dtype.py)."""
    assert devices.resolve_dtype("auto", torch.device("cpu")) is None
    assert devices.dtype_name(None) == "auto" and devices.dtype_name(torch.bfloat16) == "bfloat16"


def test_auto_dtype_on_tt_keeps_its_rule(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("INFO", logger="engine.backends.devices"):
        assert devices.resolve_dtype("auto", torch.device("cpu"), devices.PROBES["tt"]) is torch.bfloat16
    assert "dtype auto: bfloat16 (Tenstorrent cards compute in bfloat16)" in caplog.text


# --- context length -----------------------------------------------------------------------------------------


def test_context_length() -> None:
    config = SimpleNamespace(max_position_embeddings=4096)
    assert loader.context_length(config, None) == 4096
    assert loader.context_length(config, 1024) == 1024
    with pytest.raises(LoadError, match="longer than the model's context"):
        loader.context_length(config, 8192)
    nested = SimpleNamespace(text_config=SimpleNamespace(n_positions=2048))
    assert loader.context_length(nested, None) == 2048
    with pytest.raises(LoadError, match="pass --max-model-len"):
        loader.context_length(SimpleNamespace(), None)
    assert loader.context_length(SimpleNamespace(), 512) == 512


# --- loading a folder ---------------------------------------------------------------------------------------


def test_load_folder_in_each_dtype(tiny_model_dir) -> None:  # noqa: ANN001 - conftest's TinyModel
    for dtype, expected in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        cfg = EngineConfig(model_path=str(tiny_model_dir.path), model_name="tiny", device="cpu", dtype=dtype)
        loaded = loader.load_model(cfg)
        assert (loaded.device, loaded.dtype, loaded.max_model_len) == (torch.device("cpu"), expected, 512)
        assert not loaded.model.training
        assert all(p.dtype == expected and not p.requires_grad for p in loaded.model.parameters())
        assert loaded.tokenizer.eos_token_id == tiny_model_dir.eos_token_id


def test_load_folder_matches_transformers(tiny_model_dir) -> None:  # noqa: ANN001
    from transformers import AutoModelForCausalLM

    cfg = EngineConfig(model_path=str(tiny_model_dir.path), model_name="tiny", device="cpu", dtype="float32",
                       max_model_len=128)  # fmt: skip
    loaded = loader.load_model(cfg)
    reference = AutoModelForCausalLM.from_pretrained(tiny_model_dir.path, dtype=torch.float32).eval()
    ids = torch.tensor([[1, 5, 9, 42, 7]])
    with torch.no_grad():
        assert torch.equal(loaded.model(ids).logits, reference(ids).logits)
    assert loaded.max_model_len == 128


def test_folder_without_config_is_refused(tmp_path: Path) -> None:
    with pytest.raises(LoadError, match="no config.json"):
        loader.load_model(
            EngineConfig(model_path=str(tmp_path), model_name="x", device="cpu", dtype="float32")
        )


def test_missing_gguf_is_refused(tmp_path: Path) -> None:
    cfg = EngineConfig(model_path=str(tmp_path), model_name="x", gguf_file="nope.gguf", device="cpu",
                       dtype="float32", cache_dir=str(tmp_path / "cache"))  # fmt: skip
    with pytest.raises(LoadError, match="GGUF file not found"):
        loader.load_model(cfg)


# --- the GGUF cache, without converting ---------------------------------------------------------------------


def test_fingerprint_follows_content_not_time(tmp_path: Path) -> None:
    import os

    path = tmp_path / "m.gguf"
    path.write_bytes(b"GGUF" + bytes(10_000))
    first = loader.gguf_fingerprint(path)
    os.utime(path, (1, 1))
    assert loader.gguf_fingerprint(path) == first  # a reinstall with new mtimes reuses the conversion
    path.write_bytes(b"GGUF" + bytes(9_999) + b"x")
    assert loader.gguf_fingerprint(path) != first
    assert loader.gguf_cache_folder(path, tmp_path).name.startswith("m-")


def test_cached_conversion_is_used_without_converting(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF" + bytes(100))
    target = loader.gguf_cache_folder(gguf, tmp_path / "cache")
    target.mkdir(parents=True)
    (target / "peregrine.json").write_text(json.dumps({"format": loader.GGUF_CACHE_FORMAT}))
    monkeypatch.setattr(loader, "convert_gguf", lambda *a: pytest.fail("converted although cached"))
    assert loader.ensure_gguf_converted(gguf, tmp_path / "cache") == target


def test_half_written_or_old_conversions_are_redone(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF" + bytes(100))
    cache = tmp_path / "cache"
    target = loader.gguf_cache_folder(gguf, cache)
    target.mkdir(parents=True)
    (target / "model.safetensors").write_bytes(b"truncated")  # no marker: an interrupted old layout
    calls = []

    def fake_convert(path: Path, out: Path) -> None:
        calls.append(path)
        (out / "config.json").write_text("{}")
        (out / "peregrine.json").write_text(json.dumps({"format": loader.GGUF_CACHE_FORMAT}))

    monkeypatch.setattr(loader, "convert_gguf", fake_convert)
    assert loader.ensure_gguf_converted(gguf, cache) == target
    assert (
        calls == [gguf] and (target / "config.json").exists() and not (target / "model.safetensors").exists()
    )
    assert [p.name for p in target.parent.iterdir()] == [target.name]  # no temporary folder left behind


def test_failed_conversion_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF" + bytes(100))

    def broken(path: Path, out: Path) -> None:
        (out / "model.safetensors").write_bytes(b"partial")
        raise RuntimeError("disk full")

    monkeypatch.setattr(loader, "convert_gguf", broken)
    with pytest.raises(RuntimeError, match="disk full"):
        loader.ensure_gguf_converted(gguf, tmp_path / "cache")
    assert list((tmp_path / "cache" / "gguf").iterdir()) == []


# --- the real conversion (slow) -----------------------------------------------------------------------------


@pytest.mark.slow
def test_bundled_gguf_converts_faithfully_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """--weight-format dense: SmolLM2 Q4_1 -> dense float32 safetensors equal to gguf's own dequantization;
    answers correctly; the second load reuses the cache (no conversion)."""
    from models.hub import bundled_path

    try:
        gguf_path = bundled_path("smollm2")
    except Exception as exc:  # noqa: BLE001
        pytest.skip(f"bundled SmolLM2 not installed: {exc}")
    cfg = EngineConfig(model_path=str(gguf_path.parent), model_name="smollm2", gguf_file=gguf_path.name,
                       device="cpu", dtype="float32", cache_dir=str(tmp_path), weight_format="dense")  # fmt: skip
    loaded = loader.load_model(cfg)
    folder = loader.gguf_cache_folder(gguf_path, tmp_path)
    assert loader.is_converted(folder)
    assert "quantization_config" not in json.loads((folder / "config.json").read_text())
    assert loaded.max_model_len == 8192 and loaded.tokenizer.chat_template

    expected = gguf_dequantized(gguf_path, "blk.3.ffn_down.weight")
    assert torch.equal(loaded.model.model.layers[3].mlp.down_proj.weight, expected)

    messages = [{"role": "user", "content": "What is the capital of France?"}]
    ids = loaded.tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt")
    ids = ids["input_ids"] if not isinstance(ids, torch.Tensor) else ids
    out = loaded.model.generate(ids, max_new_tokens=12, do_sample=False)
    assert "Paris" in loaded.tokenizer.decode(out[0, ids.shape[1] :])

    monkeypatch.setattr(loader, "convert_gguf", lambda *a: pytest.fail("converted again"))
    again = loader.load_model(replace(cfg, dtype="bfloat16"))
    assert again.dtype is torch.bfloat16
    assert torch.equal(again.model.model.layers[3].mlp.down_proj.weight, expected.to(torch.bfloat16))


def gguf_dequantized(path: Path, name: str) -> torch.Tensor:
    """One tensor as the gguf library dequantizes it ([out, in], float32)."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    tensor = next(t for t in reader.tensors if t.name == name)
    return torch.from_numpy(gguf.quants.dequantize(tensor.data, tensor.tensor_type).copy()).float()
