"""Peregrine's generation engine: an async front over a synchronous, continuously batched step loop.

No FastAPI or pydantic here. See docs/architecture.md for the contract the HTTP layer relies on.
`AsyncEngine` and `LLMEngine` are imported lazily so that `engine.types` stays free of torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from engine.types import (
    Constraint,
    EngineConfig,
    EngineDeadError,
    EngineError,
    EngineStats,
    FinishReason,
    InvalidRequestError,
    PromptTooLongError,
    RequestOutput,
    SamplingParams,
    TokenLogprob,
    TopLogprob,
)

if TYPE_CHECKING:
    from engine.async_engine import AsyncEngine
    from engine.llm_engine import LLMEngine

__all__ = [
    "AsyncEngine",
    "Constraint",
    "EngineConfig",
    "EngineDeadError",
    "EngineError",
    "EngineStats",
    "FinishReason",
    "InvalidRequestError",
    "LLMEngine",
    "PromptTooLongError",
    "RequestOutput",
    "SamplingParams",
    "TokenLogprob",
    "TopLogprob",
]


def __getattr__(name: str) -> Any:
    if name == "AsyncEngine":
        from engine.async_engine import AsyncEngine

        return AsyncEngine
    if name == "LLMEngine":
        from engine.llm_engine import LLMEngine

        return LLMEngine
    raise AttributeError(f"module 'engine' has no attribute {name!r}")
