"""use.py's checks of Anthropic's Messages API (`/v1/messages`, `/v1/messages/count_tokens`), through the real
`anthropic` SDK: a message, a streamed one, a forced tool call, token counting and the error envelope."""

from __future__ import annotations

from typing import Any, Protocol

from use_llama_stack import QUESTION, expect

WEATHER = {
    "name": "get_weather",
    "description": "The current weather in a city.",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
ASK = [{"role": "user", "content": QUESTION}]


class AnthropicCtx(Protocol):
    """What these checks read of use.py's `Ctx`."""

    base_url: str
    api_key: str | None
    max_tokens: int
    model: str


def _client(ctx: AnthropicCtx) -> Any:
    import anthropic  # here, not at the top: use.py's other checks run without it

    return anthropic.Anthropic(base_url=ctx.base_url, api_key=ctx.api_key or "none", max_retries=0, timeout=300)


def check_messages(ctx: AnthropicCtx) -> str:
    m = _client(ctx).messages.create(model=ctx.model, max_tokens=ctx.max_tokens, messages=ASK,
                                     extra_body={"temperature": 0})
    text = "".join(b.text for b in m.content if b.type == "text")
    expect(bool(text.strip()), "empty message")
    expect(m.stop_reason in ("end_turn", "max_tokens"), f"stop_reason {m.stop_reason}")
    return f"{text!r} (stop_reason={m.stop_reason}, usage={m.usage.model_dump(exclude_none=True)})"


def check_messages_stream(ctx: AnthropicCtx) -> str:
    with _client(ctx).messages.stream(model=ctx.model, max_tokens=ctx.max_tokens, messages=ASK,
                                      extra_body={"temperature": 0}) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    expect(kinds[0] == "message_start" and kinds[-1] == "message_stop", f"events {kinds}")
    text = "".join(b.text for b in final.content if b.type == "text")
    expect(bool(text.strip()), "empty streamed message")
    return f"{text!r} ({len(kinds)} events, stop_reason={final.stop_reason})"


def check_messages_tool_use(ctx: AnthropicCtx) -> str:
    m = _client(ctx).messages.create(
        model=ctx.model, max_tokens=60, tools=[WEATHER], tool_choice={"type": "tool", "name": "get_weather"},
        messages=[{"role": "user", "content": "What is the weather in Paris?"}], extra_body={"temperature": 0},
    )
    calls = [b for b in m.content if b.type == "tool_use"]
    expect(m.stop_reason == "tool_use" and len(calls) == 1, f"no tool_use: {m.model_dump()}")
    return f"{calls[0].name}({calls[0].input})"


def check_count_tokens(ctx: AnthropicCtx) -> str:
    counted = _client(ctx).messages.count_tokens(model=ctx.model, messages=ASK, tools=[WEATHER])
    expect(counted.input_tokens > 0, f"count {counted}")
    return f"{counted.input_tokens} input tokens"


def check_messages_error(ctx: AnthropicCtx) -> str:
    import anthropic

    try:
        _client(ctx).messages.create(model="no-such-model", max_tokens=1, messages=ASK)
    except anthropic.NotFoundError as exc:
        body = exc.body if isinstance(exc.body, dict) else {}
        expect(body.get("type") == "error", f"no Anthropic error envelope: {exc.body}")
        return f"404 {body['error']['message']}"
    raise AssertionError("an unknown model was accepted")


ANTHROPIC_CHECKS = [
    ("anthropic messages", check_messages),
    ("anthropic messages stream", check_messages_stream),
    ("anthropic messages tool_use", check_messages_tool_use),
    ("anthropic count_tokens", check_count_tokens),
    ("anthropic unknown model -> 404", check_messages_error),
]
