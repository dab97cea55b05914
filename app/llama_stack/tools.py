"""Tools and structured output on the legacy Llama Stack chat route (`/inference/chat_completion` and aliases).

Requests, as llama-stack-client 0.0.x-0.2.x send them:

    tools:              [{"tool_name", "description", "parameters": {name: {"param_type", "description",
                          "required", "default"}}}]  (or "input_schema": a JSON Schema, as later clients send)
    tool_choice:        "auto" | "required" | "none" | a tool's name   (also inside tool_config, which wins)
    tool_prompt_format: "json" | "function_tag" | "python_list"       (also inside tool_config)
    response_format:    {"type": "json_schema", "json_schema": {...}} | {"type": "grammar", "bnf": GBNF}

They become the same `ToolsRequest`, and through the shared request plan (`app/chat/plan.py`) the same `ToolPlan`,
as on the OpenAI route (`app/chat/tools.py`): the model's own chat template renders
the tools, and calls are parsed from the model's own format, so `tool_prompt_format` (Llama Stack's hint for
how to *prompt* Llama models) is accepted but the template decides. Answers:

    completion_message: {"role": "assistant", "content", "stop_reason": "end_of_message",
                         "tool_calls": [{"call_id", "tool_name", "arguments": {...}, "arguments_json": "..."}]}
    stream (typed, 0.1+): progress events with delta {"type": "tool_call", "tool_call": "" | fragment | ToolCall,
                         "parse_status": "started" | "in_progress" | "succeeded"}
    stream (bare, 0.0.x): delta {"content": "" | fragment | ToolCall, "parse_status": "started" |
                         "in_progress" | "success"}
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from app.chat import structured
from app.chat.plan import ToolsRequest
from app.chat.tool_parsers import CallDelta, ParsedCall
from app.chat.tools import NamedChoice, ToolPlan
from app.errors import BadRequestError
from app.llama_stack.schemas import ChatCompletionRequest, GenerationRequest
from engine.types import Constraint

PARAM_TYPES = {
    "string": "string", "str": "string", "int": "integer", "integer": "integer", "float": "number",
    "number": "number", "bool": "boolean", "boolean": "boolean", "list": "array", "array": "array",
    "dict": "object", "object": "object",
}  # fmt: skip
PROMPT_FORMATS = (None, "json", "function_tag", "python_list")
CHOICES = ("auto", "required", "none")


# ---------------------------------------------------------------- request


def tools_request(body: ChatCompletionRequest) -> ToolsRequest:
    """The request's tool fields as the family-neutral ToolsRequest (`app/chat/plan.py`); 400 for a
    tool_choice or tool_prompt_format this API does not have."""
    config = body.tool_config or {}
    prompt_format = config.get("tool_prompt_format", body.tool_prompt_format)
    if prompt_format not in PROMPT_FORMATS:
        raise BadRequestError(
            f"Unknown tool_prompt_format {prompt_format!r} (json, function_tag or python_list).",
            param="tool_prompt_format",
        )
    choice = config.get("tool_choice", body.tool_choice)
    if isinstance(choice, str) and choice not in CHOICES:
        choice = NamedChoice(choice)
    elif choice is not None and not isinstance(choice, str):
        raise BadRequestError("tool_choice must be auto, required, none or a tool's name.", param="tool_choice")
    return ToolsRequest([_function(i, t) for i, t in enumerate(body.tools or [])], choice, True)


def _function(i: int, tool: dict[str, Any]) -> dict[str, Any]:
    """A legacy ToolDefinition as an OpenAI function ({"name", "description", "parameters"})."""
    name = tool.get("tool_name")
    if isinstance(name, dict):  # 0.0.x BuiltinTool as {"type": ...}; rare
        name = name.get("type") or name.get("name")
    if not isinstance(name, str) or not name:
        raise BadRequestError("Every tool needs a tool_name.", param=f"tools[{i}].tool_name")
    out: dict[str, Any] = {"name": name}
    if tool.get("description"):
        out["description"] = tool["description"]
    if isinstance(tool.get("input_schema"), dict):
        out["parameters"] = tool["input_schema"]
    else:
        out["parameters"] = _parameters(i, tool.get("parameters") or {})
    return out


def _parameters(i: int, params: dict[str, Any]) -> dict[str, Any]:
    properties, required = {}, []
    for name, spec in params.items():
        if not isinstance(spec, dict):
            raise BadRequestError(f"Parameter {name!r} must be an object.", param=f"tools[{i}].parameters")
        prop: dict[str, Any] = {}
        kind = PARAM_TYPES.get(str(spec.get("param_type", "")).lower())
        if kind:
            prop["type"] = kind
        if spec.get("description"):
            prop["description"] = spec["description"]
        properties[name] = prop
        if spec.get("required", True) and "default" not in spec:
            required.append(name)
    return {"type": "object", "properties": properties, "required": required}


def response_constraint(req: GenerationRequest) -> Constraint | None:
    """Llama Stack's `response_format` as an engine Constraint: `json_schema` (the schema itself) or `grammar`
    (GBNF text), parsed by the same functions as every family's structured output (`app/chat/structured.py`)."""
    fmt = req.response_format
    if fmt is None:
        return None
    kind = fmt.get("type")
    if kind == "json_schema":
        return structured.schema_constraint(fmt.get("json_schema"), "response_format.json_schema")
    if kind == "grammar":
        bnf = fmt.get("bnf")
        if isinstance(bnf, dict):  # {"root": "..."} / {"grammar": "..."}: the GBNF text inside
            bnf = bnf.get("grammar") or bnf.get("gbnf") or bnf.get("root")
        return structured.grammar_constraint(bnf, "response_format.bnf")
    raise BadRequestError(f"Unknown response_format type {kind!r} (json_schema or grammar).",
                          param="response_format.type")


# ---------------------------------------------------------------- answers


def tool_call(call: ParsedCall) -> dict[str, Any]:
    """A parsed call in Llama Stack's ToolCall shape (arguments as an object, and as JSON text)."""
    try:
        arguments = json.loads(call.arguments)
    except ValueError:
        arguments = {}
    if not isinstance(arguments, dict):
        arguments = {}
    return {"call_id": call.id, "tool_name": call.name, "arguments": arguments, "arguments_json": call.arguments}


def split_response(response: dict[str, Any], tool_plan: ToolPlan) -> dict[str, Any]:
    """Move tool calls out of `completion_message.content` (non-stream answers)."""
    message = response["completion_message"]
    stream = tool_plan.new_stream()
    content, _ = stream.feed(message.get("content") or "", final=True)
    if stream.calls:
        message["content"] = content.strip()
        message["tool_calls"] = [tool_call(c) for c in stream.calls]
        if message.get("stop_reason") == "end_of_turn":
            message["stop_reason"] = "end_of_message"
    return response


async def split_events(events: AsyncIterator[dict[str, Any]], tool_plan: ToolPlan,
                       typed: bool) -> AsyncIterator[dict[str, Any]]:
    """Chat stream events with the calls moved from text deltas into tool_call deltas."""
    stream = tool_plan.new_stream()
    for_event = _TypedDeltas() if typed else _BareDeltas()
    async for event in events:
        body = event["event"]
        kind = body["event_type"]
        if kind == "start":
            yield event
            continue
        text = body["delta"]["text"] if typed else body["delta"]
        sent = len(stream.calls)
        content, deltas = stream.feed(text, final=kind == "complete")
        out = [for_event.text(content)] if content else []
        out += [for_event.fragment(d) for d in deltas] + [for_event.done(c) for c in stream.calls[sent:]]
        logprobs = body.get("logprobs") if kind == "progress" else None
        if not out and logprobs:
            out = [for_event.text("")]
        for i, delta in enumerate(out):
            yield _progress(delta, logprobs if i == 0 else None)
        if kind == "complete":
            if stream.calls and body.get("stop_reason") == "end_of_turn":
                body["stop_reason"] = "end_of_message"
            yield event


def _progress(delta: Any, logprobs: Any) -> dict[str, Any]:
    return {"event": {"event_type": "progress", "delta": delta, "stop_reason": None, "logprobs": logprobs}}


class _TypedDeltas:
    def text(self, text: str) -> dict[str, Any]:
        return {"type": "text", "text": text}

    def fragment(self, delta: CallDelta) -> dict[str, Any]:
        status = "started" if delta.id is not None else "in_progress"
        return {"type": "tool_call", "tool_call": delta.arguments if delta.id is None else "",
                "parse_status": status}

    def done(self, call: ParsedCall) -> dict[str, Any]:
        return {"type": "tool_call", "tool_call": tool_call(call), "parse_status": "succeeded"}


class _BareDeltas:
    def text(self, text: str) -> str:
        return text

    def fragment(self, delta: CallDelta) -> dict[str, Any]:
        status = "started" if delta.id is not None else "in_progress"
        return {"content": delta.arguments if delta.id is None else "", "parse_status": status}

    def done(self, call: ParsedCall) -> dict[str, Any]:
        return {"content": tool_call(call), "parse_status": "success"}
