"""An engine from an `EngineConfig`: load the model (models/loader.py), then build the engine over it. It lives in
models/ because loading is acquisition; the engine itself imports neither models/ nor config/."""

from __future__ import annotations

import dataclasses
import gc

from engine.async_engine import AsyncEngine
from engine.draft import DraftModel, VocabularyMismatch
from engine.llm_engine import LLMEngine
from engine.types import EngineConfig
from models.loader import LoadedModel, LoadError, load_model


def build_engine(cfg: EngineConfig) -> LLMEngine:
    """The synchronous engine over the model `cfg` names, loaded on its device (and its draft model, for
    `--speculative draft`). A draft whose tokenizer is not the model's raises LoadError, with one line to show."""
    loaded = load_model(cfg)
    draft = load_draft(cfg, loaded)
    try:
        return LLMEngine(loaded.model, loaded.tokenizer, cfg, loaded.device, loaded.dtype, loaded.max_model_len,
                         draft=draft)
    except VocabularyMismatch as exc:
        assert cfg.speculative_draft is not None
        raise LoadError(f"--speculative-model {cfg.speculative_draft.model_name}: {exc}") from None


def freeze_heap() -> None:
    """Everything alive once a server has loaded its model (the libraries', the tokenizer's and the model's objects:
    about 400,000 on the bundled model) moved out of the cyclic collector's generations (`gc.freeze`, as vLLM does
    once started), so that a full collection while serving scans only what requests made since: on the bundled
    model at 16 streams one took 265 ms, holding the GIL, every stream stalled meanwhile. Called by the servers'
    loaders (main.py, serving/start.py, serving/ray_serve.py), not by build_engine: a process that builds and drops
    engines (the tests) would keep their frozen cycles for good. serving/registry.py unfreezes for an unload's
    collection and freezes again after."""
    gc.collect()
    gc.freeze()


def load_draft(cfg: EngineConfig, target: LoadedModel) -> DraftModel | None:
    """The draft model of `--speculative draft`, loaded like the model, on its device and in the dtype it was given
    (a Ray replica resolves the model's device on its node)."""
    if cfg.speculative != "draft" or cfg.speculative_draft is None:
        return None
    dtype = str(target.dtype).removeprefix("torch.")
    loaded = load_model(dataclasses.replace(cfg.speculative_draft, device=str(target.device), dtype=dtype))
    return DraftModel(loaded.model, loaded.tokenizer, loaded.max_model_len, cfg.speculative_draft.model_name)


def build_async_engine(cfg: EngineConfig) -> AsyncEngine:
    """`build_engine` behind the async front (not started: the caller calls `start()`)."""
    return AsyncEngine(build_engine(cfg), cfg.model_name)
