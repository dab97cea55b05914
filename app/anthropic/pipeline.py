"""The Messages routes' only calls into the shared chat pipeline (`app/chat`, `app/openai`): the request plan every
family builds (`app/chat/plan.py`, with Anthropic's `Options`), then generate -> reasoning and tool-call splitting,
as `POST /v1/chat/completions` does.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from typing import Any

from fastapi import Request

from app.anthropic.convert import Finish
from app.chat import reasoning
from app.chat.plan import Options, build_plan
from app.chat.tools import ToolPlan
from app.deps import Engine, engine_for, generation_defaults, reasoning_parser, tool_call_parser
from app.engine_client import generate
from app.openai import convert as conv
from app.openai import tools as openai_tools
from app.openai.schemas import ChatCompletionRequest, ChatCompletionResponse
from engine.types import RequestOutput, SamplingParams


@dataclass(slots=True)
class Plan:
    """One request made ready for the engine."""

    engine: Engine
    model: str
    params: SamplingParams
    tool_plan: ToolPlan | None
    prompt: list[int]


async def plan(request: Request, chat: ChatCompletionRequest, *, for_counting: bool = False) -> Plan:
    """Find the engine and build the shared request plan with Anthropic's meanings (`app.chat.plan.Options`): a
    last assistant turn is a prefill, `max_tokens` a cap, tool calls never refused for a schema keyword."""
    engine, model = await engine_for(request, chat.model)
    options = Options(continue_final_message=True, cap_to_context=engine.max_model_len, lenient_tools=True,
                      count_only=for_counting)
    wanted = replace(conv.chat_plan(chat, engine.vocab_size, generation_defaults(request)), options=options)
    built = await build_plan(engine.tokenizer, wanted, tool_call_parser(request))
    return Plan(engine, model, built.params, built.tool_plan, built.prompts[0])


async def _tap(outputs: AsyncIterator[tuple[int, RequestOutput]], finish: Finish) -> AsyncIterator[Any]:
    """The engine's outputs as they are, noting which stop string ended the answer (the chat form drops it)."""
    async for p, out in outputs:
        if out.finished:
            finish.finish_reason = out.finish_reason
            finish.stop_string = out.stop_reason if isinstance(out.stop_reason, str) else None
        yield p, out


def chunks(request: Request, p: Plan, rid: str, finish: Finish) -> AsyncIterator[dict[str, Any]]:
    """The chat stream's chunks (reasoning and tool calls split out, a last usage chunk)."""
    outputs = _tap(generate(p.engine, [p.prompt], p.params, rid, prompt_param="messages"), finish)
    events = conv.chat_chunks(outputs, id=rid, model=p.model, n=1, include_usage=True)
    splitter = reasoning.splitter_factory(reasoning_parser(request), p.engine.tokenizer, p.prompt)
    if splitter is not None:
        events = reasoning.split_chunks(events, splitter)
    if p.tool_plan is not None and p.tool_plan.parses:
        events = openai_tools.split_chunks(events, p.tool_plan.new_stream)
    return events


async def answer(request: Request, p: Plan, rid: str, finish: Finish) -> ChatCompletionResponse:
    """The whole answer, as the chat route would give it."""
    outputs = _tap(generate(p.engine, [p.prompt], p.params, rid, prompt_param="messages"), finish)
    result = conv.ChatResult(id=rid, model=p.model, n=1, want_logprobs=False)
    async for _, out in outputs:
        result.add(out)
    response = result.response()
    splitter = reasoning.splitter_factory(reasoning_parser(request), p.engine.tokenizer, p.prompt)
    if splitter is not None:
        response = reasoning.split_response(response, splitter)
    if p.tool_plan is not None and p.tool_plan.parses:
        response = openai_tools.split_response(response, p.tool_plan)
    return response
