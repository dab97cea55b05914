"""The Responses API's output side: the shared chat pipeline's stream chunks -> output items and the stream
events OpenAI sends, with `sequence_number`s; the non-stream answer is the same fold, its events unsent.

The event sequence (one `ResponseBuilder` per request):

    response.created, response.in_progress
    per output item, in order (a reasoning item, a message, function calls):
      response.output_item.added
      message:   response.content_part.added, response.output_text.delta*, response.output_text.done,
                 response.content_part.done
      reasoning: response.content_part.added, response.reasoning_text.delta*, response.reasoning_text.done,
                 response.content_part.done
      function:  response.function_call_arguments.delta*, response.function_call_arguments.done
      response.output_item.done
    response.completed | response.incomplete (max_output_tokens) | response.failed (with `error`)
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from app.responses.convert import new_id

Event = dict[str, Any]
ItemKind = Literal["message", "reasoning", "function_call"]


@dataclass(slots=True)
class _Open:
    """The output item being written."""

    index: int
    item: dict[str, Any]
    text: list[str] = field(default_factory=list)

    @property
    def kind(self) -> ItemKind:
        return self.item["type"]


@dataclass(slots=True)
class ResponseBuilder:
    """Folds chat chunks into one response; each method returns the stream events it produced."""

    base: dict[str, Any]  # the response's fixed fields (id, model, the echoed request settings)
    output: list[dict[str, Any]] = field(default_factory=list)
    usage: dict[str, Any] | None = None
    finish_reason: str | None = None
    result: dict[str, Any] | None = None  # the finished response (after `finish`)
    _open: _Open | None = None
    _seq: int = 0

    def snapshot(self, status: str, **extra: Any) -> dict[str, Any]:
        return {**self.base, "status": status, "output": list(self.output), "usage": self.usage, **extra}

    def start(self) -> list[Event]:
        return [self._event("response.created", response=self.snapshot("in_progress")),
                self._event("response.in_progress", response=self.snapshot("in_progress"))]

    def feed(self, chunk: Mapping[str, Any]) -> list[Event]:
        events: list[Event] = []
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            if reasoning := delta.get("reasoning_content") or delta.get("reasoning"):
                events += self._append_text("reasoning", reasoning)
            if content := delta.get("content"):
                events += self._append_text("message", content)
            for call in delta.get("tool_calls") or []:
                events += self._call(call)
            self.finish_reason = choice.get("finish_reason") or self.finish_reason
        if chunk.get("usage"):
            self.usage = _usage(chunk["usage"])
        return events

    def finish(self) -> list[Event]:
        """Close the open item and fix `result`; the last event (`response.completed`, or `.incomplete` when
        max_output_tokens cut the answer) holds it."""
        events = self._close()
        if self.finish_reason == "length":
            self.result = self.snapshot("incomplete", incomplete_details={"reason": "max_output_tokens"})
            return [*events, self._event("response.incomplete", response=self.result)]
        self.result = self.snapshot("completed", completed_at=int(time.time()))
        return [*events, self._event("response.completed", response=self.result)]

    def failed(self, message: str, code: str) -> list[Event]:
        error = {"code": code, "message": message}
        return [self._event("response.failed", response=self.snapshot("failed", error=error))]

    # ------------------------------------------------------------ items

    def _append_text(self, kind: ItemKind, text: str) -> list[Event]:
        events = [] if self._open is not None and self._open.kind == kind else [*self._close(), *self._add(kind)]
        assert self._open is not None  # opened just above
        self._open.text.append(text)
        name = "response.output_text.delta" if kind == "message" else "response.reasoning_text.delta"
        extra = {"logprobs": []} if kind == "message" else {}
        return [*events, self._event(name, item_id=self._open.item["id"], output_index=self._open.index,
                                     content_index=0, delta=text, **extra)]

    def _add(self, kind: ItemKind, **fields: Any) -> list[Event]:
        prefix = {"message": "msg", "reasoning": "rs", "function_call": "fc"}[kind]
        item: dict[str, Any] = {"id": new_id(prefix), "type": kind, "status": "in_progress", **fields}
        if kind == "message":
            item |= {"role": "assistant", "content": []}
        elif kind == "reasoning":
            item |= {"summary": [], "content": []}
        self._open = _Open(len(self.output), item)  # the item before it is closed: its index is next
        events = [self._event("response.output_item.added", output_index=self._open.index, item=dict(item))]
        if kind != "function_call":
            events.append(self._event("response.content_part.added", item_id=item["id"],
                                      output_index=self._open.index, content_index=0, part=_part(kind, "")))
        return events

    def _call(self, call: Mapping[str, Any]) -> list[Event]:
        function = call.get("function") or {}
        events: list[Event] = []
        if call.get("id"):  # a new call: id and name first, then argument fragments
            events += self._close()
            events += self._add("function_call", call_id=call["id"], name=function.get("name") or "",
                                arguments="")
        if self._open is None or self._open.kind != "function_call" or not function.get("arguments"):
            return events
        self._open.text.append(function["arguments"])
        return [*events, self._event("response.function_call_arguments.delta", item_id=self._open.item["id"],
                                     output_index=self._open.index, delta=function["arguments"])]

    def _close(self) -> list[Event]:
        opened, self._open = self._open, None
        if opened is None:
            return []
        text, item = "".join(opened.text), opened.item
        where = {"item_id": item["id"], "output_index": opened.index}
        if opened.kind == "function_call":
            done = item | {"arguments": text, "status": "completed"}
            events = [self._event("response.function_call_arguments.done", **where, name=item["name"], arguments=text)]
        else:
            part = _part(opened.kind, text)
            done = item | {"content": [part], "status": "completed"}
            name = "response.output_text.done" if opened.kind == "message" else "response.reasoning_text.done"
            extra = {"logprobs": []} if opened.kind == "message" else {}
            events = [self._event(name, **where, content_index=0, text=text, **extra),
                      self._event("response.content_part.done", **where, content_index=0, part=part)]
        self.output.append(done)
        return [*events, self._event("response.output_item.done", output_index=opened.index, item=done)]

    def _event(self, type: str, **fields: Any) -> Event:
        event = {"type": type, "sequence_number": self._seq, **fields}
        self._seq += 1
        return event


def _part(kind: ItemKind, text: str) -> dict[str, Any]:
    if kind == "message":
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
    return {"type": "reasoning_text", "text": text}


def _usage(chat: Mapping[str, Any]) -> dict[str, Any]:
    cached = (chat.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {
        "input_tokens": chat["prompt_tokens"],
        "input_tokens_details": {"cached_tokens": cached},
        "output_tokens": chat["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": chat["total_tokens"],
    }


def response_base(id: str, model: str, req: Any, created_at: int | None = None,
                  defaults: Mapping[str, float] | None = None) -> dict[str, Any]:
    """The fields of a response that echo its request (OpenAI's Response object, less status/output/usage); a
    sampling key the request left out shows the value used (the server's `defaults`, else OpenAI's)."""
    fmt = req.text.format.model_dump(by_alias=True, exclude_none=True) if req.text and req.text.format else None
    defaults = defaults or {}

    def used(value: Any, key: str, fallback: Any) -> Any:
        return value if value is not None else defaults.get(key, fallback)

    return {
        "id": id, "object": "response", "created_at": created_at or int(time.time()), "model": model,
        "instructions": req.instructions, "previous_response_id": req.previous_response_id,
        "max_output_tokens": used(req.max_output_tokens, "max_tokens", None),
        "temperature": used(req.temperature, "temperature", 1.0), "top_p": used(req.top_p, "top_p", 1.0),
        "tools": [t.model_dump(exclude_none=True) for t in req.tools or []],
        "tool_choice": _tool_choice(req.tool_choice), "parallel_tool_calls": req.parallel_tool_calls is not False,
        "text": {"format": fmt or {"type": "text"}},
        "reasoning": req.reasoning.model_dump() if req.reasoning else {"effort": None, "summary": None},
        "store": req.store, "metadata": req.metadata or {}, "truncation": "disabled", "background": False,
        "error": None, "incomplete_details": None, "user": None,
    }


def _tool_choice(choice: Any) -> Any:
    if choice is None:
        return "auto"
    return choice if isinstance(choice, str) else choice.model_dump(exclude_none=True)
