"""Tools and structured output with the real llama-stack-client 0.2.x native chat API; print what it saw as JSON.

Runs inside that client's own virtual environment, started by tests/api/test_llama_stack_tools.py, which makes
the assertions. Usage: python lsc_legacy_tools.py BASE_URL LLM_ID
"""

from __future__ import annotations

import json
import sys

from llama_stack_client import LlamaStackClient

GREEDY = {"strategy": {"type": "greedy"}, "max_tokens": 120}
WEATHER = {"tool_name": "get_weather", "description": "The current weather in a city.",
           "parameters": {"city": {"param_type": "string", "description": "The city", "required": True}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
CITY = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 30},
                                         "country": {"type": "string", "maxLength": 30}},
        "required": ["name", "country"], "additionalProperties": False}


def calls(message) -> list[dict]:
    return [{"call_id": c.call_id, "tool_name": c.tool_name, "arguments": c.arguments} for c in message.tool_calls]


def main(base_url: str, llm: str) -> None:
    client = LlamaStackClient(base_url=base_url)
    required = client.inference.chat_completion(model_id=llm, messages=ASK, tools=[WEATHER],
                                                tool_choice="required", sampling_params=GREEDY)
    events = [c.event for c in client.inference.chat_completion(
        model_id=llm, messages=ASK, tools=[WEATHER], tool_config={"tool_choice": "get_weather"},
        sampling_params=GREEDY, stream=True)]  # fmt: skip
    done = [e.delta.tool_call for e in events if e.delta.type == "tool_call" and e.delta.parse_status == "succeeded"]
    call = required.completion_message.tool_calls[0]
    history = [*ASK, {"role": "assistant", "content": "", "stop_reason": "end_of_message",
                      "tool_calls": [{"call_id": call.call_id, "tool_name": call.tool_name,
                                      "arguments": call.arguments}]},
               {"role": "tool", "call_id": call.call_id, "content": json.dumps({"sky": "clear", "celsius": 21})}]
    after = client.inference.chat_completion(model_id=llm, messages=history, tools=[WEATHER], sampling_params=GREEDY)
    structured = client.inference.chat_completion(
        model_id=llm, messages=[{"role": "user", "content": "Describe Paris."}], sampling_params=GREEDY,
        response_format={"type": "json_schema", "json_schema": CITY})
    print(json.dumps({
        "required": {"calls": calls(required.completion_message), "content": required.completion_message.content,
                     "stop_reason": required.completion_message.stop_reason},
        "stream": {"delta_types": sorted({e.delta.type for e in events}),
                   "statuses": [e.delta.parse_status for e in events if e.delta.type == "tool_call"],
                   "calls": [{"tool_name": c.tool_name, "arguments": c.arguments} for c in done],
                   "stop_reason": events[-1].stop_reason},
        "after_tool": {"content": after.completion_message.content, "calls": calls(after.completion_message)},
        "structured": structured.completion_message.content,
    }))


if __name__ == "__main__":
    main(*sys.argv[1:3])
