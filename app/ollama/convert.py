"""Ollama's one converter: its chat and generate requests -> Peregrine's chat request (the OpenAI form the shared
pipeline takes), and the pipeline's chunks -> Ollama's answers (one JSON object a line, or one object).

| Ollama                                   | Peregrine (OpenAI chat form)                              |
|------------------------------------------|-----------------------------------------------------------|
| `options.num_predict` (-1, -2: no limit) | `max_tokens`                                              |
| `options.temperature`, `top_p`, `top_k`, `min_p`, `seed`, `stop` | the same                          |
| `options.repeat_penalty`, `presence_penalty`, `frequency_penalty` | `repetition_penalty`, ...        |
| `format: "json"` / a JSON Schema         | `response_format` json_object / json_schema               |
| `tools`, message `tool_calls` (arguments as objects), `tool_name` | OpenAI tools, calls with ids, `tool_call_id` |
| `system`, `prompt` (generate)            | a system and a user message                               |
| `logprobs`, `top_logprobs`               | the same                                                  |

Durations are nanoseconds, as Ollama's: `load_duration` is the wait for the model (a load on demand included),
`prompt_eval_duration` the time to the first generated token, `eval_duration` the rest.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Literal

from pydantic import ValidationError

from app.errors import BadRequestError
from app.ollama.schemas import ChatRequest, Format, GenerateRequest, GenerationRequest, Message, Options
from app.openai.schemas import ChatCompletionRequest

OPTION_FIELDS = {  # Peregrine's field -> Ollama's, for error messages
    "max_tokens": "options.num_predict", "temperature": "options.temperature", "top_p": "options.top_p",
    "top_k": "options.top_k", "min_p": "options.min_p", "seed": "options.seed", "stop": "options.stop",
    "repetition_penalty": "options.repeat_penalty", "presence_penalty": "options.presence_penalty",
    "frequency_penalty": "options.frequency_penalty", "response_format": "format",
}
Kind = Literal["chat", "generate"]


def now_rfc3339() -> str:
    return datetime.now(UTC).isoformat().replace("+00:00", "Z")


# ---------------------------------------------------------------- Ollama -> Peregrine


def to_chat_request(body: GenerationRequest, messages: list[dict[str, Any]]) -> ChatCompletionRequest:
    """The one Ollama -> Peregrine request conversion (chat and generate); a bad value is a 400 naming
    Ollama's field."""
    fields: dict[str, Any] = {"model": body.model, "messages": messages, **_options(body.options or Options())}
    fields["response_format"] = _response_format(body.format)
    extra = body.model_extra or {}
    if extra.get("logprobs"):
        fields |= {"logprobs": True, "top_logprobs": extra.get("top_logprobs")}
    if isinstance(body, ChatRequest) and body.tools:
        fields["tools"] = [t.model_dump(exclude_none=True) for t in body.tools]
        fields["tool_choice"] = body.tool_choice
    fields |= _think(getattr(body, "think", None))
    try:
        return ChatCompletionRequest.model_validate(fields)
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = [str(p) for p in err["loc"]]
        name = ".".join([OPTION_FIELDS.get(loc[0], loc[0]), *loc[1:]]) if loc else "body"
        raise BadRequestError(f"{name}: {err['msg']}", param=name) from None


def _think(think: bool | str | None) -> dict[str, Any]:
    """Ollama's `think` as the chat template sees it: a bool switches thinking (Qwen3's `enable_thinking`), a
    level sets `reasoning_effort` (gpt-oss's template reads it); unset: the model's default."""
    if think is None:
        return {}
    if isinstance(think, bool):
        return {"chat_template_kwargs": {"enable_thinking": think}}
    return {"chat_template_kwargs": {"enable_thinking": True}, "reasoning_effort": think}


def _options(opts: Options) -> dict[str, Any]:
    if opts.num_predict == 0 or (opts.num_predict is not None and opts.num_predict < -2):
        raise BadRequestError("options.num_predict must be positive, or -1 / -2 for no limit.",
                              param="options.num_predict")
    out = {
        "max_tokens": opts.num_predict if opts.num_predict and opts.num_predict > 0 else None,
        "temperature": opts.temperature, "top_p": opts.top_p, "top_k": opts.top_k, "min_p": opts.min_p,
        "seed": opts.seed, "stop": opts.stop or None, "repetition_penalty": opts.repeat_penalty,
        "presence_penalty": opts.presence_penalty, "frequency_penalty": opts.frequency_penalty,
    }
    return {k: v for k, v in out.items() if v is not None}


def _response_format(fmt: Format) -> dict[str, Any] | None:
    if fmt is None or fmt == "":
        return None
    if fmt == "json":
        return {"type": "json_object"}
    return {"type": "json_schema", "json_schema": {"name": "format", "schema": fmt, "strict": True}}


def chat_messages(messages: list[Message]) -> list[dict[str, Any]]:
    """Ollama's messages as OpenAI's: tool calls get ids, a `tool` message answers the oldest open call of its
    `tool_name` (else the oldest open call). Images are refused: the models served here read text only."""
    out: list[dict[str, Any]] = []
    open_calls: list[tuple[str, str]] = []  # (id, name) of calls not answered yet
    for i, msg in enumerate(messages):
        no_images(msg.images, f"messages[{i}].images")
        item: dict[str, Any] = {"role": msg.role, "content": msg.content or ""}
        if msg.tool_calls:
            calls = [_call(f"call_{i}_{j}", c.function.name, c.function.arguments) for j, c in enumerate(msg.tool_calls)]
            open_calls += [(c["id"], c["function"]["name"]) for c in calls]
            item["tool_calls"] = calls
        if msg.role == "tool":
            item["tool_call_id"] = _answer(open_calls, msg.tool_name)
            if msg.tool_name:
                item["name"] = msg.tool_name
        out.append(item)
    return out


def _call(call_id: str, name: str, arguments: dict[str, Any] | str) -> dict[str, Any]:
    args = arguments if isinstance(arguments, str) else json.dumps(arguments)
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}


def _answer(open_calls: list[tuple[str, str]], name: str | None) -> str:
    match = next((c for c in open_calls if c[1] == name), open_calls[0] if open_calls else None)
    if match is None:
        return "call_none"  # a tool result without a call: the template shows it as a tool turn all the same
    open_calls.remove(match)
    return match[0]


def generate_messages(body: GenerateRequest) -> list[dict[str, Any]]:
    no_images(body.images, "images")
    system = [{"role": "system", "content": body.system}] if body.system else []
    return [*system, {"role": "user", "content": body.prompt or ""}]


def no_images(images: list[str] | None, param: str) -> None:
    if images:
        raise BadRequestError(f"{param}: the models served here read text only; they cannot take images.",
                              param=param)


# ---------------------------------------------------------------- Peregrine -> Ollama


@dataclass
class Turn:
    """One answer as it streams: turns the pipeline's OpenAI chunks into Ollama's lines and keeps the counts."""

    kind: Kind
    model: str
    started_ns: int  # when the request arrived (time.perf_counter_ns)
    load_ns: int  # waiting for the model
    first_ns: int | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    finish_reason: str | None = None
    content: list[str] = field(default_factory=list)
    thinking: list[str] = field(default_factory=list)
    logprobs: list[dict[str, Any]] = field(default_factory=list)
    calls: dict[int, dict[str, str]] = field(default_factory=dict)

    def feed(self, chunk: dict[str, Any]) -> dict[str, Any] | None:
        """Fold one chunk in; returns the Ollama line it makes (None: nothing to send yet)."""
        if chunk.get("usage"):
            self.prompt_tokens = chunk["usage"]["prompt_tokens"]
            self.completion_tokens = chunk["usage"]["completion_tokens"]
        line: dict[str, Any] = {}
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            if delta.get("role"):
                continue  # the opening chunk, sent before the engine has produced anything
            self.first_ns = self.first_ns or time.perf_counter_ns()
            self.finish_reason = choice.get("finish_reason") or self.finish_reason
            text, thought = delta.get("content") or "", delta.get("reasoning_content") or ""
            for call in delta.get("tool_calls") or []:
                slot = self.calls.setdefault(call["index"], {"name": "", "arguments": ""})
                slot["name"] += (call.get("function") or {}).get("name") or ""
                slot["arguments"] += (call.get("function") or {}).get("arguments") or ""
            lps = _logprobs(choice.get("logprobs"))
            self.content.append(text)
            self.thinking.append(thought)
            self.logprobs += lps
            if text or thought or lps:
                line = self._line(text, thought) | ({"logprobs": lps} if lps else {})
        return line or None

    def _line(self, text: str, thought: str, done: bool = False) -> dict[str, Any]:
        line: dict[str, Any] = {"model": self.model, "created_at": now_rfc3339()}
        if self.kind == "chat":
            line["message"] = {"role": "assistant", "content": text} | ({"thinking": thought} if thought else {})
        else:
            line["response"] = text
            if thought:
                line["thinking"] = thought
        return line | {"done": done}

    def tool_call_line(self) -> dict[str, Any] | None:
        """The calls made, whole (Ollama sends them in one line, arguments as objects), before the last line."""
        if not self.calls:
            return None
        line = self._line("", "")
        line["message"]["tool_calls"] = [_tool_call(self.calls[i]) for i in sorted(self.calls)]
        return line

    def last_line(self) -> dict[str, Any]:
        """`done: true` with the reason and Ollama's counts and durations (nanoseconds)."""
        end = time.perf_counter_ns()
        first = self.first_ns or end
        eval_start = self.started_ns + self.load_ns
        return self._line("", "", done=True) | {
            "done_reason": "length" if self.finish_reason == "length" else "stop",
            "total_duration": end - self.started_ns, "load_duration": self.load_ns,
            "prompt_eval_count": self.prompt_tokens, "prompt_eval_duration": max(first - eval_start, 0),
            "eval_count": self.completion_tokens, "eval_duration": end - first,
        }  # fmt: skip

    def whole(self) -> dict[str, Any]:
        """The non-stream answer: every delta joined into the last line."""
        line = self.last_line()
        text, thought = "".join(self.content), "".join(self.thinking)
        if self.kind == "chat":
            line["message"] = self._line(text, thought)["message"]
            if self.calls:
                line["message"]["tool_calls"] = [_tool_call(self.calls[i]) for i in sorted(self.calls)]
        else:
            line["response"] = text
            if thought:
                line["thinking"] = thought
        return line | ({"logprobs": self.logprobs} if self.logprobs else {})


def _tool_call(call: dict[str, str]) -> dict[str, Any]:
    try:
        arguments = json.loads(call["arguments"] or "{}")
    except json.JSONDecodeError:
        arguments = call["arguments"]  # cannot happen for constrained calls; kept as the model wrote it
    return {"function": {"name": call["name"], "arguments": arguments}}


def _logprobs(lp: dict[str, Any] | None) -> list[dict[str, Any]]:
    if not lp:
        return []
    return [
        {"token": t["token"], "logprob": t["logprob"],
         "top_logprobs": [{"token": a["token"], "logprob": a["logprob"]} for a in t.get("top_logprobs") or []]}
        for t in lp.get("content") or []
    ]  # fmt: skip
