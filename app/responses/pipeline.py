"""The Responses API's only calls into the shared chat pipeline (`app/chat`, `app/openai`, `app/engine_client`).

A Responses turn runs as the OpenAI chat route runs a streamed chat completion: sampling params, the
structured-output check, the tool plan, the prompt through the chat template, the engine, the reasoning and
tool-call splitters. What comes back is the chat route's own stream chunks (`chat.completion.chunk` dicts, the
last carrying `usage`), which `app/responses/events.py` renders as Responses events. The shared request plan
(`app/chat/plan.py`) does the params, the structured check, the tools and the prompt.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

from fastapi import Request

from app.chat import reasoning
from app.chat.plan import build_plan
from app.deps import Engine, engine_for, generation_defaults, reasoning_parser, tool_call_parser
from app.engine_client import generate
from app.openai import convert as chat_convert
from app.openai import tools as openai_tools
from app.openai.schemas import ChatCompletionRequest


async def resolve(request: Request, model: str | None, keep_alive: float | str | None) -> tuple[Engine, str]:
    """The engine serving `model` and the id to answer with (404 in OpenAI's envelope for an unknown model)."""
    return await engine_for(request, model, keep_alive)


async def chat_chunks(request: Request, engine: Engine, model: str, body: ChatCompletionRequest,
                      keep: bool = False) -> AsyncIterator[dict[str, Any]]:
    """Start `body` (a streamed chat request) on `engine`; its chunks, reasoning and tool calls split out.
    Bad input raises (a 400) before anything is generated. `keep`: a stored turn, which a next turn may continue
    (`previous_response_id`): its KV blocks outlive colder cached prefixes (`SamplingParams.keep_prefix`)."""
    chat = chat_convert.chat_plan(body, engine.vocab_size, generation_defaults(request))
    if chat.params.constraint is not None:
        chat = replace(chat, constraint_field="text.format")  # the Responses name of the structured-output field
    plan = await build_plan(engine.tokenizer, chat, tool_call_parser(request))
    prompt, tool_plan = plan.prompts[0], plan.tool_plan
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    params = replace(plan.params, keep_prefix=keep)
    outputs = generate(engine, [prompt], params, rid, prompt_param="input")
    events = chat_convert.chat_chunks(outputs, id=rid, model=model, n=1, include_usage=True)
    splitter = reasoning.splitter_factory(reasoning_parser(request), engine.tokenizer, prompt)
    if splitter is not None:
        events = reasoning.split_chunks(events, splitter)
    if plan.parses_tools:
        events = openai_tools.split_chunks(events, tool_plan.new_stream)
    return events
