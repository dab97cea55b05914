"""An engine from an `EngineConfig`: load the model (models/loader.py), then build the engine over it. It lives in
models/ because loading is acquisition; the engine itself imports neither models/ nor config/."""

from __future__ import annotations

from engine.async_engine import AsyncEngine
from engine.llm_engine import LLMEngine
from engine.types import EngineConfig
from models.loader import load_model


def build_engine(cfg: EngineConfig) -> LLMEngine:
    """The synchronous engine over the model `cfg` names, loaded on its device."""
    loaded = load_model(cfg)
    return LLMEngine(loaded.model, loaded.tokenizer, cfg, loaded.device, loaded.dtype, loaded.max_model_len)


def build_async_engine(cfg: EngineConfig) -> AsyncEngine:
    """`build_engine` behind the async front (not started: the caller calls `start()`)."""
    return AsyncEngine(build_engine(cfg), cfg.model_name)
