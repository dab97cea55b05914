"""Structured output and tools with the clients people use, installed as users install them, in their everyday
flows, against a real server with the bundled SmolLM2, greedy and sampled: every answer validates.

- openai: `json_object`, strict `json_schema` (`chat.completions.parse` with a pydantic model); its tool flows
  (`tool_choice="required"`, a named tool while streaming, a tool round trip) are in test_tools_api.py.
- langchain-openai: `with_structured_output(method="json_schema")`, `bind_tools` with a `tool_choice`.
- instructor: the JSON_SCHEMA and TOOLS modes.
- openai-agents: an agent with a function tool and `tool_choice="required"`.
- pydantic-ai: an agent whose `output_type` is a pydantic model.

The models are small and closed (`extra="forbid"`, bounded strings, enums) as a 135M model needs: a schema
that admits any extra key or any number lets it write on until max_tokens, which is valid but cut.
"""

from __future__ import annotations

import json
from typing import Any, Literal

import instructor
import openai
import pytest
from agents import (
    Agent,
    ModelSettings,
    OpenAIChatCompletionsModel,
    Runner,
    function_tool,
    set_tracing_disabled,
)
from langchain_openai import ChatOpenAI
from pydantic import BaseModel, ConfigDict, Field
from pydantic_ai import Agent as PydanticAgent
from pydantic_ai.models.openai import OpenAIChatModel
from pydantic_ai.providers.openai import OpenAIProvider

pytestmark = pytest.mark.slow

SAMPLED = [{"temperature": 0}, {"temperature": 1.0, "seed": 11}]
IDS = ["greedy", "sampled"]
ASK_CITY = "Describe Paris: its name, its country and its continent."
ASK_WEATHER = "What is the weather in Paris?"


class City(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(max_length=40)
    country: str = Field(max_length=40)
    continent: Literal["Europe", "Asia", "Africa", "America", "Oceania"]


def get_weather(city: str, unit: Literal["celsius", "fahrenheit"]) -> str:
    """Get the current weather in a city."""
    return json.dumps({"city": city, "temperature": 21, "unit": unit})


@pytest.fixture(scope="module")
def base_url(server: str) -> str:
    return f"{server}/v1"


# ---------------------------------------------------------------- openai


@pytest.mark.parametrize("sampling", SAMPLED, ids=IDS)
def test_openai_json_object(client: openai.OpenAI, model_id: str, sampling: dict[str, Any]) -> None:
    """Any JSON object: unbounded, so a sampled one may be cut by max_tokens; one that stops parses."""
    r = client.chat.completions.create(
        model=model_id, messages=[{"role": "user", "content": "Paris as a JSON object with name and country."}],
        response_format={"type": "json_object"}, max_tokens=300, **sampling,
    )
    choice = r.choices[0]
    assert choice.finish_reason == "stop" or (sampling["temperature"] > 0 and choice.finish_reason == "length")
    if choice.finish_reason == "stop":
        assert isinstance(json.loads(choice.message.content), dict)


@pytest.mark.parametrize("sampling", SAMPLED, ids=IDS)
def test_openai_strict_json_schema(client: openai.OpenAI, model_id: str, sampling: dict[str, Any]) -> None:
    r = client.chat.completions.parse(model=model_id, messages=[{"role": "user", "content": ASK_CITY}],
                                      response_format=City, max_tokens=150, **sampling)
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(r.choices[0].message.parsed, City)


# ---------------------------------------------------------------- langchain-openai


@pytest.mark.parametrize("sampling", SAMPLED, ids=IDS)
def test_langchain_structured_output(base_url: str, model_id: str, sampling: dict[str, Any]) -> None:
    llm = ChatOpenAI(base_url=base_url, api_key="none", model=model_id, max_tokens=150, max_retries=0, **sampling)
    assert isinstance(llm.with_structured_output(City, method="json_schema").invoke(ASK_CITY), City)


@pytest.mark.parametrize("sampling", SAMPLED, ids=IDS)
def test_langchain_bind_tools(base_url: str, model_id: str, sampling: dict[str, Any]) -> None:
    llm = ChatOpenAI(base_url=base_url, api_key="none", model=model_id, max_tokens=150, max_retries=0, **sampling)
    message = llm.bind_tools([get_weather], tool_choice="get_weather").invoke(ASK_WEATHER)
    [call] = message.tool_calls
    assert call["name"] == "get_weather" and call["id"].startswith("call_")
    assert set(call["args"]) == {"city", "unit"} and call["args"]["unit"] in ("celsius", "fahrenheit")
    assert isinstance(call["args"]["city"], str)


# ---------------------------------------------------------------- instructor


@pytest.mark.parametrize("mode", [instructor.Mode.JSON_SCHEMA, instructor.Mode.TOOLS], ids=["json_schema", "tools"])
@pytest.mark.parametrize("sampling", SAMPLED, ids=IDS)
def test_instructor(client: openai.OpenAI, model_id: str, mode: instructor.Mode, sampling: dict[str, Any]) -> None:
    patched = instructor.from_openai(client, mode=mode)
    city = patched.chat.completions.create(model=model_id, response_model=City, max_retries=0, max_tokens=150,
                                           messages=[{"role": "user", "content": ASK_CITY}], **sampling)
    assert isinstance(city, City)


# ---------------------------------------------------------------- openai-agents


def test_openai_agents_function_tool(base_url: str, model_id: str) -> None:
    """tool_choice="required" makes the first turn a call (the SDK then resets it to auto for the answer)."""
    set_tracing_disabled(True)
    calls: list[tuple[str, str]] = []

    @function_tool
    def weather(city: str, unit: Literal["celsius", "fahrenheit"]) -> str:
        """Get the current weather in a city."""
        calls.append((city, unit))
        return get_weather(city, unit)

    async_client = openai.AsyncOpenAI(base_url=base_url, api_key="none", max_retries=0)
    agent = Agent(
        name="weather", instructions="Answer weather questions with the weather tool.", tools=[weather],
        model=OpenAIChatCompletionsModel(model=model_id, openai_client=async_client),
        model_settings=ModelSettings(tool_choice="required", temperature=0, max_tokens=120),
    )
    result = Runner.run_sync(agent, ASK_WEATHER, max_turns=4)
    assert calls and all(isinstance(city, str) and unit in ("celsius", "fahrenheit") for city, unit in calls)
    assert isinstance(result.final_output, str)


# ---------------------------------------------------------------- pydantic-ai


@pytest.mark.parametrize("sampling", SAMPLED, ids=IDS)
def test_pydantic_ai_output_type(base_url: str, model_id: str, sampling: dict[str, Any]) -> None:
    provider = OpenAIProvider(openai_client=openai.AsyncOpenAI(base_url=base_url, api_key="none", max_retries=0))
    agent = PydanticAgent(OpenAIChatModel(model_id, provider=provider), output_type=City,
                          model_settings={"max_tokens": 150, **sampling})
    assert isinstance(agent.run_sync(ASK_CITY).output, City)
