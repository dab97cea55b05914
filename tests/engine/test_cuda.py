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


def test_cuda_speculation_answers_as_plain_decoding(tiny_cuda: Loaded) -> None:
    """n-gram speculation on the GPU (float32): greedy and seeded answers are those of plain decoding on the same
    device, batched, with proposals made and kept; the step cost is pinned so that proposals pay whatever the
    GPU's timings (the adaptive rule has its own unit tests)."""
    from engine.llm_engine import LLMEngine
    from engine.types import EngineConfig
    from tests.support import pin

    def build(**kw: Any) -> Any:
        cfg = EngineConfig(model_path="in-memory", model_name="t", device="cuda", kv_cache_bytes=8 << 20,
                           max_num_batched_tokens=64, **kw)
        return LLMEngine(tiny_cuda.model, tiny_cuda.tokenizer, cfg, torch.device("cuda"), torch.float32,
                         tiny_cuda.max_model_len)

    plain, spec = build(), build(speculative="ngram")
    pin(spec.step_cost, 0.002, 0.0001)
    enc = tiny_cuda.tokenizer.encode
    prompts = {f"r{i}": enc(t) for i, t in enumerate(["one two three four one two three four one two",
                                                      "abc abc abc abc abc", "The quick brown fox " * 3])}
    for params in (SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True),
                   SamplingParams(temperature=0.9, seed=21, max_tokens=32, ignore_eos=True)):
        requests = {r: (p, params) for r, p in prompts.items()}
        want = {r: tokens_of(o) for r, o in run_all(plain, requests).items()}
        assert {r: tokens_of(o) for r, o in run_all(spec, requests).items()} == want, params.temperature
    stats = spec.stats()
    assert stats.spec_proposed_tokens_total > 0 and stats.spec_accepted_tokens_total > 0
    assert spec.blocks.num_used_blocks == 0
