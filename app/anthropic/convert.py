"""The Messages API's one converter: an Anthropic request becomes the OpenAI chat request form the shared chat
pipeline runs (`to_chat_request`), and the pipeline's answer becomes an Anthropic message (`to_message`).

Request side: `system` (a string or text blocks) is the system message; a user turn's `tool_result` blocks become
`tool` messages (in order, before the turn's text), an assistant turn's `tool_use` blocks become `tool_calls`;
`thinking` blocks the client sends back are dropped (templates do not take them). Images are refused: every model
Peregrine serves reads text only. A `tool_result` must answer a `tool_use` of an earlier assistant turn.
Answer side: reasoning -> a `thinking` block, content -> a `text` block, each tool call -> a `tool_use` block.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from app.anthropic.schemas import (
    CountTokensRequest,
    ImageBlock,
    InputMessage,
    Message,
    MessagesRequest,
    RedactedThinkingBlock,
    StopReason,
    TextBlock,
    ThinkingBlock,
    ToolChoiceAny,
    ToolChoiceNone,
    ToolChoiceTool,
    ToolResultBlock,
    ToolUseBlock,
    Usage,
)
from app.errors import BadRequestError
from app.openai.schemas import ChatCompletionRequest, ChatCompletionResponse

TEXT_ONLY = "This server's models read text only: image blocks cannot be served."

# ---------------------------------------------------------------- request -> chat request


def to_chat_request(body: MessagesRequest | CountTokensRequest) -> ChatCompletionRequest:
    """The chat request that generates this Messages request's answer (or renders its prompt, for counting)."""
    fields: dict[str, Any] = {
        "model": body.model,
        "messages": _system(body.system) + _conversation(body.messages),
        "tools": _tools(body) or None,
        "tool_choice": _tool_choice(body),
        "parallel_tool_calls": _parallel(body),
    }
    if isinstance(body, MessagesRequest):
        fields |= {
            "max_tokens": body.max_tokens, "stop": body.stop_sequences, "temperature": body.temperature,
            "top_p": body.top_p, "top_k": body.top_k, "stream": body.stream,
            "stream_options": {"include_usage": True} if body.stream else None,
        }  # fmt: skip
    try:
        return ChatCompletionRequest.model_validate({k: v for k, v in fields.items() if v is not None})
    except ValidationError as exc:  # nothing the schemas let through should get here; a 400, never a 500
        raise BadRequestError(f"The request cannot be served: {exc.errors()[0]['msg']}") from None


def _system(system: str | list[TextBlock] | None) -> list[dict[str, Any]]:
    text = system if isinstance(system, str) or system is None else "\n\n".join(b.text for b in system)
    return [{"role": "system", "content": text}] if text else []


def _conversation(messages: list[InputMessage]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    calls: set[str] = set()  # the tool_use ids of the assistant turns so far
    for i, message in enumerate(messages):
        blocks = [TextBlock(type="text", text=message.content)] if isinstance(message.content, str) else message.content
        if message.role == "system":
            out.append({"role": "system", "content": _system_text(i, blocks)})
        elif message.role == "assistant":
            out.extend(_assistant(i, blocks, calls))
        else:
            out.extend(_user(i, blocks, calls))
    return out


def _system_text(i: int, blocks: list[Any]) -> str:
    for j, block in enumerate(blocks):
        if not isinstance(block, TextBlock):
            raise BadRequestError(f"A system turn holds text only, not a {block.type} block.",
                                  param=f"messages.{i}.content.{j}")
    return "\n\n".join(block.text for block in blocks)


def _assistant(i: int, blocks: list[Any], calls: set[str]) -> list[dict[str, Any]]:
    texts, tool_calls = [], []
    for j, block in enumerate(blocks):
        if isinstance(block, TextBlock):
            texts.append(block.text)
        elif isinstance(block, ToolUseBlock):
            calls.add(block.id)
            arguments = json.dumps(block.input, ensure_ascii=False)
            tool_calls.append({"id": block.id, "type": "function",
                               "function": {"name": block.name, "arguments": arguments}})
        elif not isinstance(block, ThinkingBlock | RedactedThinkingBlock):
            raise BadRequestError(f"An assistant turn cannot hold a {block.type} block.",
                                  param=f"messages.{i}.content.{j}")
    return [{"role": "assistant", "content": "".join(texts), **({"tool_calls": tool_calls} if tool_calls else {})}]


def _user(i: int, blocks: list[Any], calls: set[str]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    texts: list[str] = []
    for j, block in enumerate(blocks):
        where = f"messages.{i}.content.{j}"
        if isinstance(block, TextBlock):
            texts.append(block.text)
        elif isinstance(block, ToolResultBlock):
            if block.tool_use_id not in calls:
                raise BadRequestError(
                    f"tool_result block answers tool_use_id {block.tool_use_id!r}, which no earlier assistant "
                    "tool_use block has.", param=f"{where}.tool_use_id",
                )
            out.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": _result_text(block, where)})
        elif isinstance(block, ImageBlock):
            raise BadRequestError(TEXT_ONLY, param=where)
        else:
            raise BadRequestError(f"A user turn cannot hold a {block.type} block.", param=where)
    if texts or not out:
        out.append({"role": "user", "content": "".join(texts)})
    return out


def _result_text(block: ToolResultBlock, where: str) -> str:
    if block.content is None or isinstance(block.content, str):
        text = block.content or ""
    else:
        if any(isinstance(part, ImageBlock) for part in block.content):
            raise BadRequestError(TEXT_ONLY, param=f"{where}.content")
        text = "".join(part.text for part in block.content if isinstance(part, TextBlock))
    return f"Error: {text}" if block.is_error else text


def _tools(body: MessagesRequest | CountTokensRequest) -> list[dict[str, Any]]:
    out = []
    for i, tool in enumerate(body.tools or []):
        if tool.type not in (None, "custom") or tool.input_schema is None:
            raise BadRequestError(
                f"Tool {tool.name!r} (type {tool.type or 'custom'}) is not a client tool with an input_schema: "
                "this server runs no server tools.", param=f"tools.{i}",
            )
        function = {"name": tool.name, "description": tool.description, "parameters": tool.input_schema}
        out.append({"type": "function", "function": {k: v for k, v in function.items() if v is not None}})
    return out


def _tool_choice(body: MessagesRequest | CountTokensRequest) -> Any:
    choice = body.tool_choice
    if choice is None or not body.tools:
        return "none" if isinstance(choice, ToolChoiceNone) else None if choice is None else _needs_tools(choice)
    if isinstance(choice, ToolChoiceNone):
        return "none"
    if isinstance(choice, ToolChoiceAny):
        return "required"
    if isinstance(choice, ToolChoiceTool):
        return {"type": "function", "function": {"name": choice.name}}
    return "auto"


def _needs_tools(choice: Any) -> Any:
    if choice.type in ("any", "tool"):
        raise BadRequestError(f"tool_choice {choice.type!r} requires tools.", param="tool_choice")
    return None


def _parallel(body: MessagesRequest | CountTokensRequest) -> bool | None:
    choice = body.tool_choice
    return False if getattr(choice, "disable_parallel_tool_use", False) else None


# ---------------------------------------------------------------- answer -> message


@dataclass(slots=True)
class Finish:
    """How the answer ended, as the engine said (the chat form keeps no stop string)."""

    finish_reason: str | None = None
    stop_string: str | None = None


def stop_reason(finish_reason: str | None, finish: Finish, stop_sequences: list[str] | None) -> StopReason | None:
    """OpenAI's finish_reason (after tool parsing) -> Anthropic's stop_reason."""
    if finish_reason == "tool_calls":
        return "tool_use"
    if finish_reason == "length":
        return "max_tokens"
    if finish_reason is None:
        return None
    return "stop_sequence" if stop_sequence(finish, stop_sequences) is not None else "end_turn"


def stop_sequence(finish: Finish, stop_sequences: list[str] | None) -> str | None:
    return finish.stop_string if finish.stop_string in (stop_sequences or ()) else None


def usage(prompt_tokens: int, output_tokens: int, cached_tokens: int) -> Usage:
    """Anthropic counts the cache reads apart from `input_tokens`."""
    return Usage(input_tokens=prompt_tokens - cached_tokens, output_tokens=output_tokens,
                 cache_read_input_tokens=cached_tokens)


def tool_input(arguments: str) -> dict[str, Any]:
    """A parsed call's arguments as the `input` object (the grammar keeps them a JSON object)."""
    try:
        value = json.loads(arguments or "{}")
    except json.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}


def to_message(response: ChatCompletionResponse, finish: Finish, body: MessagesRequest) -> Message:
    choice = response.choices[0]
    message, blocks = choice.message, []
    if message.reasoning_content:
        blocks.append({"type": "thinking", "thinking": message.reasoning_content, "signature": ""})
    if message.content:
        blocks.append({"type": "text", "text": message.content})
    for call in message.tool_calls:
        blocks.append({"type": "tool_use", "id": call.id, "name": call.function.name,
                       "input": tool_input(call.function.arguments)})
    details = response.usage.prompt_tokens_details
    return Message(
        id=response.id, model=response.model, content=blocks,
        stop_reason=stop_reason(choice.finish_reason, finish, body.stop_sequences),
        stop_sequence=stop_sequence(finish, body.stop_sequences),
        usage=usage(response.usage.prompt_tokens, response.usage.completion_tokens,
                    details.cached_tokens if details else 0),
    )  # fmt: skip
