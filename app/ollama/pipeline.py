"""Every call this package makes into the shared chat pipeline (app/chat, app/openai, the engine client), in one
place, so that re-pointing Ollama's routes at another shared request plan touches this file only.

An Ollama chat or generate request arrives here as an OpenAI `ChatCompletionRequest` (`convert.to_chat_request`)
and runs exactly as `POST /v1/chat/completions` streams it: sampling params, the structured-output check, the tool
plan, the chat template, the engine, then the reasoning and tool-call splitters over the chunk stream. What comes
out is OpenAI's chat chunk dicts, the usage chunk last; `convert.py` renders them as Ollama's lines.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

from fastapi import Request

from app.chat import reasoning
from app.chat.plan import build_plan
from app.chat.prompts import check_token_ids
from app.deps import Engine, engine_for, generation_defaults, reasoning_parser, tool_call_parser
from app.engine_client import generate
from app.openai import convert as openai_convert
from app.openai import tools as openai_tools
from app.openai.embeddings import get_embedder, run_embed
from app.openai.schemas import ChatCompletionRequest
from models.embedder import Embedder, EmbeddingResult

__all__ = ["Engine", "chat_events", "embed", "engine_for", "get_embedder", "raw_prompt_ids"]


async def chat_events(
    request: Request, engine: Engine, model: str, body: ChatCompletionRequest, prompt_ids: list[int] | None = None,
    prompt_param: str = "messages",
) -> AsyncIterator[dict[str, Any]]:
    """Start the request (raising a 4xx before anything is sent when it cannot run) and return its chunk stream.
    `prompt_ids` (a raw prompt) replaces the chat template; tools need the template, so they are not planned then."""
    wanted = openai_convert.chat_plan(body, engine.vocab_size, generation_defaults(request))
    if prompt_ids is not None:
        wanted = replace(wanted, tools=None, conversations=(), prompt_ids=[prompt_ids])
    plan = await build_plan(engine.tokenizer, wanted, tool_call_parser(request))
    rid = f"ollama-{uuid.uuid4().hex}"
    outputs = generate(engine, plan.prompts, plan.params, rid, prompt_param=prompt_param)
    events = openai_convert.chat_chunks(outputs, id=rid, model=model, n=1, include_usage=True)
    splitter = reasoning.splitter_factory(reasoning_parser(request), engine.tokenizer, plan.prompts[0])
    if splitter is not None:
        events = reasoning.split_chunks(events, splitter)
    if plan.parses_tools and plan.tool_plan is not None:
        events = openai_tools.split_chunks(events, plan.tool_plan.new_stream)
    return events


def raw_prompt_ids(engine: Engine, text: str, context: list[int] | None) -> list[int]:
    """A raw prompt's token ids (no chat template), after an earlier answer's `context` ids if given."""
    ids = list(check_token_ids(context or [], engine.vocab_size, "context"))
    return ids + (list(engine.tokenizer.encode(text)) if text else [])


async def embed(embedder: Embedder, texts: list[str], dimensions: int | None, truncate: bool) -> EmbeddingResult:
    return await run_embed(embedder, texts, dimensions, strict_length=not truncate, param="input")
