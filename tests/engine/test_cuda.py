"""The same engine on a CUDA device (bf16). Skipped, with the reason, where no GPU is visible."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from engine.types import SamplingParams
from tests.support import Loaded, hf_greedy, run_all, tokens_of

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (torch.cuda.is_available() is False)"),
]


@pytest.fixture(scope="module")
def tiny_cuda(tiny: Any) -> Loaded:
    return Loaded(copy.deepcopy(tiny.model).to("cuda", torch.float32), tiny.tokenizer, tiny.max_model_len)


def test_cuda_greedy_matches_hf_and_frees_kv(tiny_cuda: Loaded) -> None:
    from engine.llm_engine import LLMEngine
    from engine.types import EngineConfig

    cfg = EngineConfig(model_path="in-memory", model_name="t", device="cuda", kv_cache_bytes=4 << 20)
    engine = LLMEngine(tiny_cuda.model, tiny_cuda.tokenizer, cfg, torch.device("cuda"), torch.float32,
                       tiny_cuda.max_model_len)
    prompts = [tiny_cuda.tokenizer.encode(t) for t in ["Hello world", "The quick brown fox " * 5]]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    outs = run_all(engine, {f"r{i}": (p, params) for i, p in enumerate(prompts)})
    for i, p in enumerate(prompts):
        assert tokens_of(outs[f"r{i}"]) == hf_greedy(tiny_cuda.model, p, 16)
    assert engine.blocks.num_used_blocks == 0
    assert engine.kv_cache.k[0].device.type == "cuda"


def test_cuda_seeded_sampling_and_bf16(tiny: Any) -> None:
    from engine.llm_engine import LLMEngine
    from engine.types import EngineConfig

    model = copy.deepcopy(tiny.model).to("cuda", torch.bfloat16)
    cfg = EngineConfig(model_path="in-memory", model_name="t", device="cuda", kv_cache_bytes=4 << 20)
    engine = LLMEngine(model, tiny.tokenizer, cfg, torch.device("cuda"), torch.bfloat16, tiny.max_model_len)
    prompt = tiny.tokenizer.encode("Hello world")
    params = SamplingParams(temperature=1.0, seed=11, max_tokens=12, ignore_eos=True, logprobs=2)
    first = run_all(engine, {"a": (prompt, params)})["a"]
    second = run_all(engine, {"b": (prompt, params), "c": (prompt, SamplingParams(max_tokens=5))})["b"]
    assert tokens_of(first) == tokens_of(second) and len(tokens_of(first)) == 12
    assert all(o.logprobs and len(o.logprobs[0].top) == 2 for o in first)
    assert engine.blocks.num_used_blocks == 0
