"""OpenAI tool calls in the answer: moved out of `content` into `message.tool_calls` (non-stream) or into OpenAI's
tool-call deltas (streams: the name first, then argument fragments). The request side, shared by every family,
is `app/chat/tools.py` and `app/chat/plan.py`."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

from app.chat.tool_parsers import CallDelta, CallStream, parse
from app.chat.tools import ToolPlan
from app.openai.schemas import (
    ChatCompletionResponse,
    DeltaFunction,
    DeltaToolCall,
    FunctionCall,
    ToolCallOut,
)


def split_response(response: ChatCompletionResponse, tool_plan: ToolPlan) -> ChatCompletionResponse:
    """Move each choice's tool calls out of `content` into `message.tool_calls` (non-stream answers)."""
    for choice in response.choices:
        content, calls = parse(tool_plan.fmt, choice.message.content or "", tool_plan.names,
                               None if tool_plan.parallel else 1)
        if not calls:
            continue
        choice.message.content = content.strip() or None
        choice.message.tool_calls = [
            ToolCallOut(id=c.id, function=FunctionCall(name=c.name, arguments=c.arguments)) for c in calls
        ]
        if choice.finish_reason == "stop":
            choice.finish_reason = "tool_calls"
    return response


async def split_chunks(events: AsyncIterator[dict[str, Any]],
                       new_stream: Callable[[], CallStream]) -> AsyncIterator[dict[str, Any]]:
    """Move tool calls from `delta.content` to OpenAI tool-call deltas in chat stream chunks, one parser per
    choice; a choice that made calls finishes with `tool_calls`."""
    streams: dict[int, CallStream] = {}
    async for event in events:
        for choice in event.get("choices") or []:
            delta = choice.get("delta") or {}
            if delta.get("role"):
                continue
            stream = streams.setdefault(choice["index"], new_stream())
            final = choice.get("finish_reason") is not None
            content, calls = stream.feed(delta.pop("content", None) or "", final=final)
            if content:
                delta["content"] = content
            if calls:
                delta["tool_calls"] = [_delta_dict(c) for c in calls]
            if final and stream.calls and choice["finish_reason"] == "stop":
                choice["finish_reason"] = "tool_calls"
            choice["delta"] = delta
        if not _empty(event):
            yield event


def _delta_dict(delta: CallDelta) -> dict[str, Any]:
    if delta.id is None:
        return DeltaToolCall(index=delta.index, function=DeltaFunction(arguments=delta.arguments)).model_dump()
    function = DeltaFunction(name=delta.name, arguments=delta.arguments)
    return DeltaToolCall(index=delta.index, id=delta.id, type="function", function=function).model_dump()


def _empty(event: dict[str, Any]) -> bool:
    choices = event.get("choices")
    return bool(choices) and event.get("usage") is None and all(
        not c.get("delta") and c.get("finish_reason") is None and c.get("logprobs") is None for c in choices
    )
