"""Anthropic's stream: the shared chat pipeline's chunks (reasoning and tool calls already split out) rendered as
Messages API events, and their SSE framing (`event: <type>` then `data: <json>`: the SDKs dispatch on the event
name).

    message_start, ping,
    (content_block_start, content_block_delta*, content_block_stop)*   thinking / text / tool_use blocks, in order
    message_delta (stop_reason, stop_sequence, usage), message_stop

A failure after the stream started goes out as Anthropic's `error` event (`AnthropicSSE.encode` turns the shared
layers' error body into it).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from app.anthropic.convert import Finish, stop_reason, stop_sequence, usage
from app.anthropic.errors import envelope, type_of_openai_error


@dataclass(frozen=True, slots=True)
class AnthropicSSE:
    """The framing `app/streaming.py`'s `stream_response` writes with (duck-typed as its StreamFormat)."""

    media_type: str = "text/event-stream"

    def encode(self, event: Mapping[str, Any]) -> bytes:
        if "type" not in event and isinstance(event.get("error"), dict):  # the shared layers' error body
            error = event["error"]
            event = envelope(type_of_openai_error(str(error.get("type"))), str(error.get("message")))
        data = json.dumps(event, ensure_ascii=False, separators=(",", ":"))
        return f"event: {event['type']}\ndata: {data}\n\n".encode()

    def end(self) -> bytes:
        return b""


@dataclass(slots=True)
class _Blocks:
    """The content block being streamed: its index and kind ("thinking", "text", "tool_use")."""

    index: int = -1
    kind: str | None = None
    events: list[dict[str, Any]] = field(default_factory=list)

    def open(self, kind: str, block: dict[str, Any]) -> None:
        self.close()
        self.index, self.kind = self.index + 1, kind
        self.events.append({"type": "content_block_start", "index": self.index, "content_block": block})

    def close(self) -> None:
        if self.kind is not None:
            self.events.append({"type": "content_block_stop", "index": self.index})
            self.kind = None

    def delta(self, delta: dict[str, Any]) -> None:
        self.events.append({"type": "content_block_delta", "index": self.index, "delta": delta})

    def take(self) -> list[dict[str, Any]]:
        out, self.events = self.events, []
        return out


def _render(delta: Mapping[str, Any], blocks: _Blocks) -> None:
    if thinking := delta.get("reasoning_content"):
        if blocks.kind != "thinking":
            blocks.open("thinking", {"type": "thinking", "thinking": "", "signature": ""})
        blocks.delta({"type": "thinking_delta", "thinking": thinking})
    if text := delta.get("content"):
        if blocks.kind != "text":
            blocks.open("text", {"type": "text", "text": ""})
        blocks.delta({"type": "text_delta", "text": text})
    for call in delta.get("tool_calls") or ():
        function = call.get("function") or {}
        if call.get("id") is not None:  # a new call: its id and name come first
            block = {"type": "tool_use", "id": call["id"], "name": function.get("name"), "input": {}}
            blocks.open("tool_use", block)
        if function.get("arguments"):
            blocks.delta({"type": "input_json_delta", "partial_json": function["arguments"]})


async def message_events(
    chunks: AsyncIterator[dict[str, Any]], *, id: str, model: str, prompt_tokens: int, finish: Finish,
    stop_sequences: list[str] | None,
) -> AsyncIterator[dict[str, Any]]:
    """Anthropic events of one answer, from the chat pipeline's chunks (one choice, a last usage chunk)."""
    start_usage = usage(prompt_tokens, 0, 0).model_dump()
    yield {"type": "message_start", "message": {
        "id": id, "type": "message", "role": "assistant", "model": model, "content": [],
        "stop_reason": None, "stop_sequence": None, "usage": start_usage}}  # fmt: skip
    yield {"type": "ping"}
    blocks, reason, final_usage = _Blocks(), None, start_usage
    async for chunk in chunks:
        for choice in chunk.get("choices") or ():
            _render(choice.get("delta") or {}, blocks)
            reason = choice.get("finish_reason") or reason
        if (u := chunk.get("usage")) is not None:
            cached = (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
            final_usage = usage(u["prompt_tokens"], u["completion_tokens"], cached).model_dump()
        for event in blocks.take():
            yield event
    blocks.close()
    for event in blocks.take():
        yield event
    yield {"type": "message_delta", "usage": final_usage, "delta": {
        "stop_reason": stop_reason(reason, finish, stop_sequences),
        "stop_sequence": stop_sequence(finish, stop_sequences)}}  # fmt: skip
    yield {"type": "message_stop"}
