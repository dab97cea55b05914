"""The Responses API's converter and event builder, without a model: items -> chat messages (and the 400s),
chat chunks -> output items and OpenAI's event sequence."""

from __future__ import annotations

import pytest

from app.errors import BadRequestError
from app.responses.convert import output_messages, to_turn
from app.responses.events import ResponseBuilder, response_base
from app.responses.schemas import ResponsesRequest


def _req(**body: object) -> ResponsesRequest:
    return ResponsesRequest.model_validate(body)


def test_items_become_chat_messages() -> None:
    req = _req(instructions="Be brief.", input=[
        {"role": "developer", "content": "Rules."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
        {"type": "function_call", "call_id": "c1", "name": "w", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "w", "arguments": "{\"a\": 1}"},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        {"type": "reasoning", "summary": []},
    ], max_output_tokens=5, text={"format": {"type": "json_object"}})
    turn = to_turn(req, [])
    roles = [m.role for m in turn.chat.messages]
    assert roles == ["system", "system", "user", "assistant", "tool"]
    assert [c["id"] for c in turn.chat.messages[3].tool_calls] == ["c1", "c2"]  # one parallel turn
    assert turn.chat.max_tokens == 5 and turn.chat.response_format == {"type": "json_object"}
    assert turn.history[0] == {"role": "system", "content": "Rules."}  # instructions are not kept
    assert all(item["id"] for item in turn.input_items) and len(turn.input_items) == 6


@pytest.mark.parametrize(("effort", "passed"), [("high", "high"), ("low", "low"), ("minimal", None), ("xhigh", None),
                                               (None, None)])
def test_reasoning_effort_reaches_the_chat_template_where_it_names_a_level(effort: str | None,
                                                                          passed: str | None) -> None:
    """gpt-oss's template takes low / medium / high; other efforts (Codex sends its own) are accepted and dropped."""
    reasoning = {"effort": effort, "summary": "auto"} if effort else None
    turn = to_turn(_req(input="Hi", reasoning=reasoning), [])
    assert turn.chat.reasoning_effort == passed


def test_a_continuation_knows_earlier_calls() -> None:
    earlier = output_messages([{"type": "function_call", "call_id": "c9", "name": "w", "arguments": "{}"}])
    turn = to_turn(_req(input=[{"type": "function_call_output", "call_id": "c9", "output": "ok"}]), earlier)
    assert [m.role for m in turn.chat.messages] == ["assistant", "tool"]


@pytest.mark.parametrize(("body", "param"), [
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content[0]"),
    ({"input": [{"type": "function_call_output", "call_id": "nope", "output": "x"}]}, "input[0].call_id"),
    ({"input": [{"type": "computer_call"}]}, "input[0].type"),
    ({"input": "hi", "tools": [{"type": "file_search"}]}, "tools[0].type"),
    ({"input": "hi", "tools": [{"type": "namespace", "name": "n", "tools": [{"type": "web_search"}]}]},
     "tools[0].tools[0].type"),
    ({"input": "hi", "tool_choice": {"type": "web_search"}}, "tool_choice"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{"}]}, "input[0].arguments"),
])
def test_refusals_name_the_field(body: dict, param: str) -> None:
    with pytest.raises(BadRequestError) as caught:
        to_turn(_req(**body), [])
    assert caught.value.param == param


def _chunk(delta: dict, finish: str | None = None) -> dict:
    return {"choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}


def test_builder_event_sequence() -> None:
    builder = ResponseBuilder(response_base("resp_1", "m", _req(input="hi")))
    events = builder.start()
    events += builder.feed(_chunk({"reasoning_content": "hmm"}))
    events += builder.feed(_chunk({"content": "Hel"}))
    events += builder.feed(_chunk({"content": "lo"}))
    events += builder.feed(_chunk({"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                                                    "function": {"name": "w", "arguments": ""}}]}))
    events += builder.feed(_chunk({"tool_calls": [{"index": 0, "function": {"arguments": "{}"}}]}, "tool_calls"))
    events += builder.feed({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7,
                                                     "prompt_tokens_details": {"cached_tokens": 2}}})
    events += builder.finish()
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e["type"].removeprefix("response.") for e in events] == [
        "created", "in_progress",
        "output_item.added", "content_part.added", "reasoning_text.delta", "reasoning_text.done",
        "content_part.done", "output_item.done",
        "output_item.added", "content_part.added", "output_text.delta", "output_text.delta", "output_text.done",
        "content_part.done", "output_item.done",
        "output_item.added", "function_call_arguments.delta", "function_call_arguments.done", "output_item.done",
        "completed",
    ]
    final = events[-1]["response"]
    assert [o["type"] for o in final["output"]] == ["reasoning", "message", "function_call"]
    assert final["output"][1]["content"][0]["text"] == "Hello" and final["output"][2]["arguments"] == "{}"
    assert final["usage"]["input_tokens_details"]["cached_tokens"] == 2 and final["status"] == "completed"
    assert [e["output_index"] for e in events if e["type"] == "response.output_item.done"] == [0, 1, 2]


def test_length_is_incomplete() -> None:
    builder = ResponseBuilder(response_base("resp_2", "m", _req(input="hi")))
    builder.feed(_chunk({"content": "x"}, "length"))
    assert builder.finish()[-1]["type"] == "response.incomplete"
    assert builder.result["incomplete_details"] == {"reason": "max_output_tokens"}
