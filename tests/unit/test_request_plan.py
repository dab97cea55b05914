"""The one request plan (app/chat/plan.py) that every API family runs: the structured constraint compiled (a 400
naming the family's field), the tool plan and its constraint, prompts rendered or passed through, and the same
plan from the OpenAI and the Llama Stack wire shapes of one request. A tiny byte-level tokenizer, no model."""

from __future__ import annotations

import asyncio

import pytest

from app.chat.plan import PlanRequest, ToolsRequest, build_plan
from app.chat.tools import NamedChoice
from app.errors import BadRequestError
from app.llama_stack import convert as llama_conv
from app.llama_stack.schemas import ChatCompletionRequest as LegacyChat
from app.openai import convert as openai_conv
from app.openai.schemas import ChatCompletionRequest, ChatMessage
from engine.types import Constraint, SamplingParams
from tests.support import build_byte_level_tokenizer

WEATHER = {"name": "get_weather", "description": "The weather in a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


@pytest.fixture(scope="module")
def tok():
    return build_byte_level_tokenizer()


def plan(tok, request: PlanRequest, parser: str = "auto"):
    return asyncio.run(build_plan(tok, request, parser))


def test_completion_prompts_pass_through_with_the_constraint_compiled(tok) -> None:
    params = SamplingParams(constraint=Constraint("regex", "[0-9]+"))
    out = plan(tok, PlanRequest(params, "guided_regex", prompt_ids=[[5, 6], [7]]))
    assert out.prompts == [[5, 6], [7]]
    assert out.params == params and out.tool_plan is None and not out.parses_tools


def test_a_constraint_that_does_not_compile_is_a_400_naming_the_familys_field(tok) -> None:
    params = SamplingParams(constraint=Constraint("gbnf", "root ::= nonsense ::="))
    with pytest.raises(BadRequestError) as err:
        plan(tok, PlanRequest(params, "response_format.bnf", prompt_ids=[[5]]))
    assert err.value.param == "response_format.bnf"


def test_chat_renders_each_conversation_with_the_tools(tok) -> None:
    messages = [ChatMessage(role="user", content="Weather in Paris?")]
    tools = ToolsRequest([WEATHER], "required", parallel=False)
    out = plan(tok, PlanRequest(SamplingParams(), None, tools, conversations=[messages, messages]), "smollm2")
    assert len(out.prompts) == 2 and out.prompts[0] == out.prompts[1]
    assert "get_weather" in tok.decode(out.prompts[0])  # the tools reached the prompt
    assert out.parses_tools and out.tool_plan.choice == "required"
    assert out.params.constraint == out.tool_plan.constraint and out.params.constraint.kind == "lark"


def test_tools_beside_a_structured_constraint_are_a_400(tok) -> None:
    params = SamplingParams(constraint=Constraint("json_object", ""))
    request = PlanRequest(params, "response_format", ToolsRequest([WEATHER], NamedChoice("get_weather")),
                          conversations=[[ChatMessage(role="user", content="hi")]])  # fmt: skip
    with pytest.raises(BadRequestError) as err:
        plan(tok, request)
    assert err.value.param == "tool_choice"


def test_a_tool_choice_without_tools_is_a_400(tok) -> None:
    request = PlanRequest(SamplingParams(), None, ToolsRequest([], "required"),
                          conversations=[[ChatMessage(role="user", content="hi")]])  # fmt: skip
    with pytest.raises(BadRequestError, match="tool_choice requires tools"):
        plan(tok, request)


def test_one_request_in_two_wire_shapes_makes_one_plan(tok) -> None:
    """The same conversation, tool and tool choice sent as OpenAI and as legacy Llama Stack: same prompt, same
    tool plan, same constraint (the converters only map wire fields; the plan is shared)."""
    openai_body = ChatCompletionRequest.model_validate({
        "model": "m", "messages": [{"role": "user", "content": "Weather in Paris?"}],
        "tools": [{"type": "function", "function": WEATHER}], "tool_choice": "required",
        "parallel_tool_calls": True, "temperature": 0})  # fmt: skip
    legacy_body = LegacyChat.model_validate({
        "model_id": "m", "messages": [{"role": "user", "content": "Weather in Paris?"}],
        "tools": [{"tool_name": "get_weather", "description": "The weather in a city.",
                   "input_schema": WEATHER["parameters"]}],
        "tool_choice": "required", "sampling_params": {"strategy": {"type": "greedy"}}})  # fmt: skip
    a = plan(tok, openai_conv.chat_plan(openai_body, tok.vocab_size), "smollm2")
    b = plan(tok, llama_conv.chat_plan(legacy_body), "smollm2")
    assert a.prompts == b.prompts
    assert a.tool_plan == b.tool_plan
    assert a.params.constraint == b.params.constraint
