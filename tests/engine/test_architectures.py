"""transformers architectures on the generic forward pass beyond the Llama family: what the paged attention serves
token for token as transformers' own generate does (Llama 4's chunked attention, given by its mask only), and what
it refuses at load with one clear error because it would answer wrongly from the second token on: models that
compute attention themselves (Falcon), that carry a recurrent or convolution state between steps (LFM2, Mamba
hybrids), or that use multi-head latent attention (DeepSeek V2/V3). Tiny random models built here."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from engine.model.attention import UnsupportedModel
from engine.types import EngineConfig, SamplingParams
from tests.support import Loaded, free_port, hf_greedy, run_all, tokens_of

SMALL = {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
         "max_position_embeddings": 256, "pad_token_id": 0}  # fmt: skip
PROMPTS = ["The quick brown fox jumps over the lazy dog. " * 2, "Hello world", "def add(a, b):"]


def random_model(tokenizer: Any, model_type: str, seed: int = 0, **config: Any) -> Any:
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg = AutoConfig.for_model(model_type, vocab_size=len(tokenizer), **SMALL, **config)
    return AutoModelForCausalLM.from_config(cfg).eval()


@pytest.mark.parametrize("kernels", [True, False], ids=["cpu-kernels", "torch-ops"])
def test_llama4_chunked_attention_matches_hf(engine_factory: Any, tiny: Any, kernels: bool) -> None:
    """Chunks of 8 positions on the chunked layers (transformers says so by the mask only), full attention on the
    others; prompts longer than a chunk, batched with chunked prefill."""
    model = random_model(tiny.tokenizer, "llama4_text", num_key_value_heads=2, head_dim=16, num_local_experts=4,
                         intermediate_size_mlp=96, attention_chunk_size=8)
    engine = engine_factory(Loaded(model, tiny.tokenizer, 256), max_num_batched_tokens=16, cpu_kernels=kernels)
    prompts = [tiny.tokenizer.encode(t) for t in PROMPTS]
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outs = run_all(engine, {f"r{i}": (p, greedy) for i, p in enumerate(prompts)})
    for i, p in enumerate(prompts):
        assert tokens_of(outs[f"r{i}"]) == hf_greedy(model, p, 12)


REFUSED = {  # model_type -> (config, what the error names)
    "falcon": ({"new_decoder_architecture": True, "num_kv_heads": 2}, "computes attention itself"),
    "lfm2": ({"num_key_value_heads": 2, "layer_types": ["conv", "full_attention"], "block_ff_dim": 96},
             "carries a state from step to step (conv layers)"),
    "mamba": ({}, "carries a state from step to step"),
    "deepseek_v2": ({"num_key_value_heads": 4, "n_routed_experts": 4, "num_experts_per_tok": 2,
                     "moe_intermediate_size": 32, "kv_lora_rank": 16, "q_lora_rank": 16, "qk_rope_head_dim": 8,
                     "qk_nope_head_dim": 8, "v_head_dim": 16, "first_k_dense_replace": 1, "n_group": 1,
                     "topk_group": 1}, "multi-head latent attention"),
}  # fmt: skip


@pytest.mark.parametrize("model_type", sorted(REFUSED))
def test_architectures_the_cache_cannot_serve_are_refused(engine_factory: Any, tiny: Any, model_type: str) -> None:
    config, says = REFUSED[model_type]
    model = random_model(tiny.tokenizer, model_type, **config)
    with pytest.raises(UnsupportedModel, match=says.replace("(", r"\(").replace(")", r"\)")):
        engine_factory(Loaded(model, tiny.tokenizer, 256))


def test_the_loader_refuses_them_with_one_line(tiny: Any, tmp_path: Path) -> None:
    """`main.py` prints a LoadError as one line (no traceback): the start stops before any KV cache is sized."""
    from models.loader import LoadError, load_model

    folder = tmp_path / "falcon"
    random_model(tiny.tokenizer, "falcon", new_decoder_architecture=True, num_kv_heads=2).save_pretrained(folder)
    tiny.tokenizer.save_pretrained(folder)
    cfg = EngineConfig(model_path=str(folder), model_name="falcon", device="cpu", dtype="float32", cpu_kernels=False)
    with pytest.raises(LoadError, match="FalconForCausalLM computes attention itself"):
        load_model(cfg)


@pytest.mark.parametrize("skip_preflight", [False, True], ids=["preflight", "load"])
def test_main_refuses_them_in_one_line_before_serving(tiny: Any, tmp_path: Path, skip_preflight: bool) -> None:
    """Through main.py: the preflight reads config.json and refuses before anything is downloaded or loaded; with
    --skip-preflight the load refuses. Either way exit 1, one line, no traceback."""
    import os
    import subprocess
    import sys

    folder = tmp_path / "falcon"
    random_model(tiny.tokenizer, "falcon", new_decoder_architecture=True, num_kv_heads=2).save_pretrained(folder)
    tiny.tokenizer.save_pretrained(folder)
    repo = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if not k.startswith("PEREGRINE_")}
    cmd = [sys.executable, str(repo / "main.py"), "--model", str(folder), "--device", "cpu", "--dtype", "float32",
           "--embedding-model", "none", "--host", "127.0.0.1", "--port", str(free_port()),
           *(["--skip-preflight"] if skip_preflight else [])]  # fmt: skip
    result = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 1, result.stderr
    refusals = [line for line in result.stderr.splitlines() if "FalconForCausalLM computes attention itself" in line]
    assert len(refusals) == 1 and "Traceback" not in result.stderr
    assert ("listening on" in result.stderr) is skip_preflight  # the preflight refuses before the server starts
