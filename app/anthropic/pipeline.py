"""The Messages routes' only calls into the shared chat pipeline (`app/chat`, `app/openai`): the same steps, in the
same order, as `POST /v1/chat/completions` (params -> structured-output check -> tool plan -> prompt ids ->
generate -> reasoning and tool-call splitting). Kept in this one module so they can be re-pointed at a shared
request plan in one place.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from typing import Any

from fastapi import Request

from app.anthropic.convert import Finish
from app.chat import prompts, reasoning, structured
from app.chat.plan import plan_tools
from app.chat.tools import ToolPlan
from app.deps import Engine, engine_for, reasoning_parser, tool_call_parser
from app.engine_client import generate
from app.errors import BadRequestError
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
    """Find the engine, build the params, check the constraints and render the prompt (tools included)."""
    engine, model = await engine_for(request, chat.model)
    params = conv.to_sampling_params(chat, engine.vocab_size)
    parser = tool_call_parser(request)
    tool_plan = plan_tools(conv.tools_request(chat), engine.tokenizer, parser)
    if not for_counting:  # the constraint matters only to generate
        tool_plan = _lenient(tool_plan, chat, engine.tokenizer, parser)
    if tool_plan is not None:
        params = tool_plan.sampling_params(params)
    prompt = _prompt_ids(engine.tokenizer, chat, tool_plan)
    if for_counting:
        return Plan(engine, model, params, tool_plan, prompt)
    params = _fit(params, len(prompt), engine.max_model_len)
    if tool_plan is not None:  # after the length check: compiling many tools' grammar takes a while
        await structured.check(tool_plan.constraint, engine.tokenizer, "tools")
    return Plan(engine, model, params, tool_plan, prompt)


LENIENT = {"x-guidance": {"lenient": True}}  # the grammar library skips JSON Schema keywords it does not implement


def _lenient(plan: ToolPlan | None, chat: ChatCompletionRequest, tokenizer: Any, parser: str) -> ToolPlan | None:
    """The plan with a grammar that ignores the schema keywords the grammar library lacks (Claude Code's tools use
    `propertyNames`, which would make the whole request a 400; Anthropic does not constrain calls at all). The
    prompt keeps the schemas as the client sent them."""
    if plan is None or plan.constraint is None:
        return plan
    tools_ = [t.model_copy(update={"function": t.function.model_copy(
        update={"parameters": {**(t.function.parameters or {}), **LENIENT}})}) for t in chat.tools or ()]
    lenient = plan_tools(conv.tools_request(chat.model_copy(update={"tools": tools_})), tokenizer, parser)
    return replace(plan, constraint=lenient.constraint if lenient is not None else plan.constraint)


def _prompt_ids(tokenizer: Any, chat: ChatCompletionRequest, tool_plan: ToolPlan | None) -> list[int]:
    """The rendered conversation. A last assistant turn of text is a prefill (Anthropic's): the answer continues
    it rather than starting a new turn."""
    last = chat.messages[-1]
    if last.role != "assistant" or last.tool_calls:
        return prompts.chat_prompt_ids(tokenizer, chat.messages, tool_plan)
    text = prompts.chat_prompt_text(tokenizer, chat.messages, add_generation_prompt=False,
                                    continue_final_message=True, tool_plan=tool_plan)
    return list(tokenizer.encode(text, add_special_tokens=False))


def _fit(params: SamplingParams, prompt_len: int, context: int) -> SamplingParams:
    """`max_tokens` is a cap in Anthropic's API and clients send large ones (Claude Code: 32000): generate at
    most what the context has room for, ending with `max_tokens` there. A prompt that leaves no room is a 400."""
    room = context - prompt_len
    if room < 1:
        raise BadRequestError(
            f"The prompt ({prompt_len} tokens, tools and system included) does not fit this model's context of "
            f"{context} tokens.", param="messages", code="context_length_exceeded",
        )
    return replace(params, max_tokens=min(params.max_tokens or room, room))


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
