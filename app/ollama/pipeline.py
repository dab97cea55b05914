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
from typing import Any

from fastapi import Request

from app.chat import prompts, reasoning, structured, tools
from app.chat.prompts import check_token_ids
from app.deps import Engine, engine_for, reasoning_parser, tool_call_parser
from app.engine_client import generate
from app.openai import convert as openai_convert
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
    params = openai_convert.to_sampling_params(body, engine.vocab_size)
    await structured.check(params.constraint, engine.tokenizer, structured.field_of(body))
    tool_plan = tools.plan(body, engine.tokenizer, tool_call_parser(request)) if prompt_ids is None else None
    if tool_plan is not None:
        params = tool_plan.sampling_params(params)
        await structured.check(tool_plan.constraint, engine.tokenizer, "tools")
    prompt = prompt_ids if prompt_ids is not None else prompts.chat_prompt_ids(engine.tokenizer, body.messages,
                                                                               tool_plan)
    rid = f"ollama-{uuid.uuid4().hex}"
    outputs = generate(engine, [prompt], params, rid, prompt_param=prompt_param)
    events = openai_convert.chat_chunks(outputs, id=rid, model=model, n=1, include_usage=True)
    splitter = reasoning.splitter_factory(reasoning_parser(request), engine.tokenizer, prompt)
    if splitter is not None:
        events = reasoning.split_chunks(events, splitter)
    if tool_plan is not None and tool_plan.parses:
        events = tools.split_chunks(events, tool_plan.new_stream)
    return events


def raw_prompt_ids(engine: Engine, text: str, context: list[int] | None) -> list[int]:
    """A raw prompt's token ids (no chat template), after an earlier answer's `context` ids if given."""
    ids = list(check_token_ids(context or [], engine.vocab_size, "context"))
    return ids + (list(engine.tokenizer.encode(text)) if text else [])


async def embed(embedder: Embedder, texts: list[str], dimensions: int | None, truncate: bool) -> EmbeddingResult:
    return await run_embed(embedder, texts, dimensions, strict_length=not truncate, param="input")
