"""The Responses API's one converter, request side: a Responses request (plus the stored conversation it
continues) -> the OpenAI chat request the shared chat pipeline runs (`app/responses/pipeline.py`).

| Responses                                        | chat completions                                   |
|--------------------------------------------------|----------------------------------------------------|
| `instructions`                                   | a leading system message                           |
| `input` string / message items (`input_text`, `output_text` parts) | user / system / assistant messages |
| `function_call` items                            | an assistant message's `tool_calls`                |
| `function_call_output` items                     | `tool` messages (the call must be in the conversation) |
| `reasoning` items                                | dropped (the template does not take them back)     |
| `max_output_tokens`                              | `max_tokens`                                       |
| `text.format` (`json_object`, `json_schema`)     | `response_format`                                  |
| function `tools`, `tool_choice` `{type, name}`   | `tools` `{type, function}`, `tool_choice` `{type, function: {name}}` |

Every refusal is a `BadRequestError` naming the field (`input[1].content[0]`), in OpenAI's envelope.
The output side (engine deltas -> output items and stream events) is `app/responses/events.py`.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from app.errors import BadRequestError
from app.openai.schemas import ChatCompletionRequest
from app.responses.schemas import InputItem, ResponsesRequest, Tool

TEXT_PARTS = ("input_text", "output_text", "text")
ROLES = ("user", "system", "developer", "assistant")
PASSED_THROUGH = ("temperature", "top_p", "seed", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                  "frequency_penalty", "stop", "ignore_eos", "min_tokens", "parallel_tool_calls", "keep_alive")


@dataclass(frozen=True, slots=True)
class Turn:
    """One request made ready: the chat request to run, the conversation so far (no instructions) and this
    turn's input items as stored (each with an id)."""

    chat: ChatCompletionRequest
    history: list[dict[str, Any]]  # chat messages: earlier turns + this turn's input
    input_items: list[dict[str, Any]]


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def to_turn(req: ResponsesRequest, earlier: list[dict[str, Any]]) -> Turn:
    """The chat request for `req`, continuing the conversation `earlier` (chat messages, from the store)."""
    items = [InputItem(type="message", role="user", content=req.input)] if isinstance(req.input, str) else req.input
    messages = _messages(items, _call_ids(earlier))
    history = [*earlier, *messages]
    system = [{"role": "system", "content": req.instructions}] if req.instructions else []
    body: dict[str, Any] = {"messages": [*system, *history], "stream": True, "n": 1}
    body |= {k: getattr(req, k) for k in PASSED_THROUGH if getattr(req, k) is not None}
    body |= {"max_tokens": req.max_output_tokens, "stream_options": {"include_usage": True}}
    body |= _tools(req)
    if req.reasoning is not None and req.reasoning.effort in ("low", "medium", "high"):  # gpt-oss's template's levels
        body["reasoning_effort"] = req.reasoning.effort
    if (fmt := _response_format(req)) is not None:
        body["response_format"] = fmt
    try:
        chat = ChatCompletionRequest.model_validate(body)
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = [str(p) for p in err.get("loc", ())] or ["input"]
        raise BadRequestError(f"{'.'.join(loc)}: {err['msg']}", param=loc[0]) from None
    if not history:
        raise BadRequestError("input holds no message to answer.", param="input")
    return Turn(chat, history, [_stored_item(i) for i in items])


# ---------------------------------------------------------------- input items -> chat messages


def _messages(items: list[InputItem], known_calls: set[str]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        kind = item.type or "message"
        if kind == "message":
            out.append(_message(i, item))
        elif kind == "function_call":
            call = _function_call(i, item)
            known_calls.add(call["id"])
            _append_call(out, call)
        elif kind == "function_call_output":
            out.append(_function_output(i, item, known_calls))
        elif kind != "reasoning":
            raise BadRequestError(
                f"input[{i}] has type {kind!r}; this server takes message, function_call, function_call_output "
                "and reasoning items.", param=f"input[{i}].type",
            )
    return out


def _message(i: int, item: InputItem) -> dict[str, Any]:
    if item.role not in ROLES:
        raise BadRequestError(f"input[{i}].role must be one of {', '.join(ROLES)} (got {item.role!r}).",
                              param=f"input[{i}].role")
    return {"role": "system" if item.role == "developer" else item.role, "content": _text(i, item.content)}


def _text(i: int, content: str | list[dict[str, Any]] | None) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    texts = []
    for j, part in enumerate(content):
        kind, param = part.get("type"), f"input[{i}].content[{j}]"
        if kind in ("input_image", "input_file", "input_audio"):
            raise BadRequestError(f"This model reads text only: {param} is {kind}, which it cannot take.",
                                  param=param, code="unsupported_content")
        if kind not in TEXT_PARTS or not isinstance(part.get("text"), str):
            raise BadRequestError(f"{param} must be an input_text part with a text string (got type {kind!r}).",
                                  param=param)
        texts.append(part["text"])
    return "".join(texts)


def _function_call(i: int, item: InputItem) -> dict[str, Any]:
    if not item.call_id or not item.name:
        raise BadRequestError(f"input[{i}] (function_call) needs call_id and name.", param=f"input[{i}]")
    arguments = item.arguments or "{}"
    try:
        json.loads(arguments)
    except ValueError:
        raise BadRequestError(f"input[{i}].arguments must be JSON text.", param=f"input[{i}].arguments") from None
    return {"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": arguments}}


def _append_call(out: list[dict[str, Any]], call: dict[str, Any]) -> None:
    """Consecutive function calls are one assistant turn (a parallel call)."""
    last = out[-1] if out else None
    if last is not None and last["role"] == "assistant" and last.get("tool_calls") and not last.get("content"):
        last["tool_calls"].append(call)
    else:
        out.append({"role": "assistant", "content": None, "tool_calls": [call]})


def _function_output(i: int, item: InputItem, known_calls: set[str]) -> dict[str, Any]:
    if item.call_id not in known_calls:
        raise BadRequestError(
            f"input[{i}] (function_call_output) answers call_id {item.call_id!r}, but no function_call with that "
            "call_id is in this conversation.", param=f"input[{i}].call_id",
        )
    output = item.output if isinstance(item.output, str) or item.output is None else _text(i, item.output)
    return {"role": "tool", "tool_call_id": item.call_id, "content": output or ""}


def _call_ids(messages: list[dict[str, Any]]) -> set[str]:
    return {c["id"] for m in messages for c in m.get("tool_calls") or []}


def _stored_item(item: InputItem) -> dict[str, Any]:
    data = item.model_dump(exclude_none=True)
    data.setdefault("type", "message")
    if data["type"] == "message" and isinstance(data.get("content"), str):
        data["content"] = [{"type": "input_text", "text": data["content"]}]
    data.setdefault("id", new_id("msg" if data["type"] == "message" else "item"))
    return data


# ---------------------------------------------------------------- tools and text.format


def _tools(req: ResponsesRequest) -> dict[str, Any]:
    out: dict[str, Any] = {}
    functions = []
    for i, tool in _flat_tools(req.tools or []):
        if tool.type != "function":
            raise BadRequestError(
                f"tools[{i}] is a hosted {tool.type!r} tool, which a local server cannot run; only function tools "
                "are served.", param=f"tools[{i}].type", code="unsupported_tool",
            )
        spec = {"name": tool.name, "description": tool.description, "parameters": tool.parameters,
                "strict": tool.strict}
        functions.append({"type": "function", "function": {k: v for k, v in spec.items() if v is not None}})
    if functions:
        out["tools"] = functions
    choice = req.tool_choice
    if isinstance(choice, str):
        out["tool_choice"] = choice
    elif choice is not None:
        if choice.type != "function" or not choice.name:
            raise BadRequestError(f"tool_choice {{type: {choice.type!r}}} cannot be served; use none, auto, "
                                  "required or {type: function, name}.", param="tool_choice")
        out["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
    return out


def _flat_tools(tools: list[Tool]) -> list[tuple[str, Tool]]:
    """(index, tool) with each `namespace` tool's function tools in its place (the Codex CLI groups some so)."""
    out = []
    for i, tool in enumerate(tools):
        inner = getattr(tool, "tools", None) if tool.type == "namespace" else None
        if isinstance(inner, list):
            out += [(f"{i}].tools[{j}", _tool(t, f"tools[{i}].tools[{j}]")) for j, t in enumerate(inner)]
        else:
            out.append((str(i), tool))
    return out


def _tool(data: Any, param: str) -> Tool:
    try:
        return Tool.model_validate(data)
    except ValidationError:
        raise BadRequestError(f"{param} must be a tool object with a type.", param=param) from None


def _response_format(req: ResponsesRequest) -> dict[str, Any] | None:
    fmt = req.text.format if req.text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "json_object"}
    if fmt.schema_ is None:
        raise BadRequestError("text.format of type json_schema needs a schema.", param="text.format.schema")
    return {"type": "json_schema",
            "json_schema": {"name": fmt.name or "response", "schema": fmt.schema_, "strict": fmt.strict}}


# ---------------------------------------------------------------- output items -> chat messages (next turn)


def output_messages(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A response's output items as the chat messages a continuation replays."""
    out: list[dict[str, Any]] = []
    for item in output:
        if item["type"] == "message":
            text = "".join(p.get("text", "") for p in item.get("content", []))
            out.append({"role": "assistant", "content": text})
        elif item["type"] == "function_call":
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            _append_call(out, call)
    return out
