"""app/llama_stack/tools.py: the legacy Llama Stack tool fields become the same tool plan as OpenAI's, and its
answers and streams carry the parsed calls."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from app.errors import BadRequestError
from tests.support import NoToolsTokenizer


def plan(body: Any, tokenizer: Any, parser: str = "auto") -> Any:
    """A legacy request's ToolPlan, as the shared request plan makes it (app/chat/plan.py)."""
    from app.chat.plan import plan_tools
    from app.llama_stack import tools as llama_stack_tools

    return plan_tools(llama_stack_tools.tools_request(body), tokenizer, parser)


def legacy_request(**fields: Any) -> Any:
    from app.llama_stack.schemas import ChatCompletionRequest as LegacyRequest

    tool = {"tool_name": "get_weather", "description": "Weather in a city",
            "parameters": {"city": {"param_type": "string", "description": "The city"},
                           "days": {"param_type": "int", "required": False}}}
    return LegacyRequest.model_validate({"model_id": "m", "messages": [{"role": "user", "content": "hi"}],
                                         "tools": [tool]} | fields)


def test_legacy_tools_become_a_plan() -> None:

    p = plan(legacy_request(tool_choice="required"), NoToolsTokenizer())
    assert p.choice == "required" and p.functions == [{
        "name": "get_weather", "description": "Weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "The city"},
                                                        "days": {"type": "integer"}}, "required": ["city"]}}]
    named = plan(legacy_request(tool_config={"tool_choice": "get_weather"}), NoToolsTokenizer())
    assert named.choice == "function"
    assert plan(legacy_request(tool_prompt_format="json"), NoToolsTokenizer()).choice == "auto"
    for fields, param in [({"tool_choice": "get_time"}, "tool_choice"), ({"tool_prompt_format": "xml"},
                                                                         "tool_prompt_format")]:
        with pytest.raises(BadRequestError) as err:
            plan(legacy_request(**fields), NoToolsTokenizer())
        assert err.value.param == param


def test_legacy_answers_carry_tool_calls() -> None:
    from app.llama_stack import tools as llama_stack_tools

    p = plan(legacy_request(), NoToolsTokenizer(), "smollm2")
    text = '<tool_call>[{"name": "get_weather", "arguments": {"city": "Paris"}}]</tool_call>'
    response = {"completion_message": {"role": "assistant", "content": text, "stop_reason": "end_of_turn",
                                       "tool_calls": []}}
    message = llama_stack_tools.split_response(response, p)["completion_message"]
    assert message["content"] == "" and message["stop_reason"] == "end_of_message"
    [call] = message["tool_calls"]
    assert call["tool_name"] == "get_weather" and call["arguments"] == {"city": "Paris"}
    assert json.loads(call["arguments_json"]) == {"city": "Paris"} and call["call_id"].startswith("call_")

    async def events(typed: bool):
        delta = (lambda t: {"type": "text", "text": t}) if typed else (lambda t: t)
        yield {"event": {"event_type": "start", "delta": delta(""), "stop_reason": None, "logprobs": None}}
        for i in range(0, len(text), 5):
            yield {"event": {"event_type": "progress", "delta": delta(text[i:i + 5]), "stop_reason": None,
                             "logprobs": None}}
        yield {"event": {"event_type": "complete", "delta": delta(""), "stop_reason": "end_of_turn",
                         "logprobs": None}}

    async def collect(typed: bool) -> list[dict[str, Any]]:
        return [e["event"] async for e in llama_stack_tools.split_events(events(typed), p, typed)]

    typed = asyncio.run(collect(True))
    assert typed[-1]["event_type"] == "complete" and typed[-1]["stop_reason"] == "end_of_message"
    deltas = [e["delta"] for e in typed[1:-1]]
    assert all(d["type"] == "tool_call" for d in deltas)
    assert deltas[0]["parse_status"] == "started" and deltas[-1]["parse_status"] == "succeeded"
    assert deltas[-1]["tool_call"]["arguments"] == {"city": "Paris"}
    assert "".join(d["tool_call"] for d in deltas[1:-1]) == call["arguments_json"]
    bare = asyncio.run(collect(False))
    assert bare[-2]["delta"]["parse_status"] == "success" and bare[-2]["delta"]["content"]["tool_name"] == "get_weather"
