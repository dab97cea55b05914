"""`openai-agents` against a real server with its default model, the Responses one: a run whose agent calls a
function tool (forced by `tool_choice`, so a call is certain with the small model), gets the tool's result
back through `function_call_output` and finishes with a message."""

from __future__ import annotations

import asyncio

import agents
import openai
import pytest

pytestmark = pytest.mark.slow


def test_agent_runs_a_tool_through_the_responses_model(server: str, model_id: str) -> None:
    calls: list[str] = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        calls.append(city)
        return "sunny"

    client = openai.AsyncOpenAI(base_url=f"{server}/v1", api_key="none", max_retries=0, timeout=300)
    agents.set_tracing_disabled(True)
    agents.set_default_openai_client(client, use_for_tracing=False)
    agents.set_default_openai_api("responses")
    settings = agents.ModelSettings(tool_choice="get_weather", max_tokens=40, temperature=0)
    agent = agents.Agent(name="weather", instructions="Answer briefly.", tools=[get_weather], model=model_id,
                         model_settings=settings)
    result = asyncio.run(agents.Runner.run(agent, "What is the weather in Paris?", max_turns=4))
    kinds = [type(item).__name__ for item in result.new_items]
    assert len(calls) == 1 and calls[0]
    assert kinds[:2] == ["ToolCallItem", "ToolCallOutputItem"] and kinds[-1] == "MessageOutputItem"
    assert isinstance(result.final_output, str)
    assert all(r.usage.input_tokens > 0 for r in result.raw_responses)
