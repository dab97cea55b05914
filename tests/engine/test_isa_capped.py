"""The engine and the API on a smaller CPU: AVX-512 and AMX hidden through the ISA cap avx2 (EngineConfig.cpu_isa, --cpu-isa).

Most self-hosters' CPUs have AVX2 and no AVX-512. This module runs the paths such a CPU takes on every
machine CI runs on (`engine.backends.cpu_features` caps the kernels at the ceiling; the API server also gets torch's
own AVX2 kernels through ATEN_CPU_CAPABILITY), so a change that breaks them fails here and not only on a
user's machine. On a machine that has only AVX2 (or less) the cap changes nothing and the tests still run.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from engine.backends import cpu_features
from engine.types import SamplingParams
from tests.support import chat_ids, hf_greedy, run_all, text_of, tokens_of

CAP = "avx2"


@pytest.fixture
def capped() -> str:
    """The kernels' level under the cap (engines built with `cpu_isa=CAP` pick their kernels under it)."""
    level = cpu_features.isa_level(cap=CAP)
    assert level in ("none", "avx2")  # never AVX-512 or AMX while capped
    return level


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


@pytest.mark.parametrize("impl", ["llama", "generic"])
def test_tiny_greedy_matches_hf_with_avx512_hidden(
    capped: str, tiny: Any, engine_factory: Any, impl: str
) -> None:
    prompts = [tiny.tokenizer.encode(p) for p in ("Hello world", "The quick brown fox jumps over " * 5)]
    refs = [hf_greedy(tiny.model, p, 16) for p in prompts]
    engine = engine_factory(tiny, max_num_batched_tokens=16, model_impl=impl, cpu_isa=CAP)  # chunked prefill + decodes
    outs = run_all(engine, {f"r{i}": (p, greedy(16)) for i, p in enumerate(prompts)})
    assert [tokens_of(outs[f"r{i}"]) for i in range(len(prompts))] == refs


@pytest.mark.slow
def test_smollm2_bf16_batch_invariant_with_avx512_hidden(
    capped: str, smollm2: Any, engine_factory: Any
) -> None:
    """The bundled model in bfloat16, the dtype the kernels serve: N identical greedy requests sent together
    answer exactly like the one sent alone."""
    engine = engine_factory(smollm2, kv_cache_bytes=32 << 20, max_num_batched_tokens=64, cpu_isa=CAP)
    prompt = chat_ids(smollm2.tokenizer, "What is the capital of France?")
    alone = run_all(engine, {"solo": (prompt, greedy(12))})["solo"]
    together = run_all(engine, {f"r{i}": (prompt, greedy(12)) for i in range(4)})
    assert all(tokens_of(together[f"r{i}"]) == tokens_of(alone) for i in range(4))
    assert "Paris" in text_of(alone)


@pytest.mark.slow
def test_smollm2_fp32_matches_hf_with_avx512_hidden(
    capped: str, smollm2_fp32: Any, engine_factory: Any
) -> None:
    tok = smollm2_fp32.tokenizer
    prompts = [chat_ids(tok, "What is the capital of France?"), chat_ids(tok, "Name three colors.")]
    refs = [hf_greedy(smollm2_fp32.model, p, 12) for p in prompts]
    engine = engine_factory(smollm2_fp32, kv_cache_bytes=32 << 20, max_num_batched_tokens=64, cpu_isa=CAP)
    together = run_all(engine, {f"r{i}": (p, greedy(12)) for i, p in enumerate(prompts)})
    assert [tokens_of(together[f"r{i}"]) for i in range(2)] == refs


# --- the API, from a server started with --cpu-isa avx2 ------------------------------------------------


@pytest.fixture(scope="module")
def avx2_server(tiny_model_dir: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from tests.api._tiny_server import TinyServer

    os.environ["ATEN_CPU_CAPABILITY"] = CAP  # torch's own kernels too, in the server process only
    try:
        server = TinyServer(tiny_model_dir.path, tmp_path_factory.mktemp("avx2-server"), "--cpu-isa", CAP,
                            "--dtype", "bfloat16", "--log-level", "info")  # fmt: skip
    finally:
        del os.environ["ATEN_CPU_CAPABILITY"]
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


@pytest.mark.slow
def test_api_basics_on_an_avx2_server(avx2_server: Any) -> None:
    log = avx2_server.log_tail(100_000)
    assert "CPU kernels' instruction set: avx2" in log or "instruction set: none" in log, log
    client = openai.OpenAI(base_url=f"{avx2_server.url}/v1", api_key="none", max_retries=0, timeout=300)
    chat = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=8,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert chat.choices[0].finish_reason == "length" and chat.usage.completion_tokens == 8
    streamed = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}],
                                              max_tokens=8, temperature=0, stream=True,
                                              extra_body={"ignore_eos": True})  # fmt: skip
    text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    assert text == chat.choices[0].message.content  # greedy: the stream says what the plain answer said
    done = client.completions.create(model="tiny", prompt=["a b c", "d e f"], max_tokens=4, temperature=0.7,
                                     seed=3, extra_body={"ignore_eos": True})  # fmt: skip
    assert sorted(c.index for c in done.choices) == [0, 1] and done.usage.completion_tokens == 8
    bad = httpx.post(f"{avx2_server.url}/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": -1},
                     timeout=60)  # fmt: skip
    assert bad.status_code == 400 and "error" in bad.json()
