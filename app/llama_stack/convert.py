"""The legacy Llama Stack API's one converter: wire request -> (messages, SamplingParams), engine outputs -> wire.

`to_sampling_params` is the only place a legacy request becomes engine `SamplingParams` (`chat_plan` and
`completion_plan` hand it to the request plan every family shares, `app/chat/plan.py`):

| `sampling_params.strategy`                          | temperature            | top_p          | top_k |
|-----------------------------------------------------|------------------------|----------------|-------|
| `{"type": "greedy"}` / `"greedy"`                   | 0 (greedy)             | 1              | off   |
| `{"type": "top_p", "temperature", "top_p"}` / `"top_p"` with them beside it | given, else 1 | given, else 0.95 | off |
| `{"type": "top_k", "top_k"}` / `"top_k"` with `top_k` (and `temperature`) beside it | given (0.0.x), else 1 | 1 | given |

`max_tokens` 0 or absent means the rest of the context; `repetition_penalty` and `stop` carry over;
`logprobs: {"top_k": k}` returns `k` alternatives per token (and the chosen token). `response_format`
(`json_schema`, `grammar`) and the tool fields are mapped in `app/llama_stack/tools.py`.

Responses, as llama-stack-client reads them:

    chat:        {"completion_message": {"role": "assistant", "content", "stop_reason", "tool_calls": []},
                  "logprobs": [{"logprobs_by_token": {token: logprob}}, ...] | null, "metrics": [...]}
    chat stream: {"event": {"event_type": "start" | "progress" | "complete", "delta", "stop_reason", "logprobs"}}
                 where `delta` is {"type": "text", "text": ...} (0.1.0 and later, the `/v1/inference/*` routes)
                 or the bare text (0.0.x, the `/inference/*` and `/alpha/inference/*` routes)
    completion:  {"content", "stop_reason", "logprobs", "metrics"}; stream chunks {"delta", "stop_reason", "logprobs"}

`stop_reason` is `end_of_turn` (end of sequence or a stop string) or `out_of_tokens` (max_tokens or the
context is full). `metrics` carries prompt/completion/total token counts, as the Llama Stack server did.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from app.chat.plan import PlanRequest
from app.errors import BadRequestError
from app.llama_stack import tools as llama_stack_tools
from app.llama_stack.schemas import (
    BatchChatCompletionRequest,
    ChatCompletionRequest,
    Content,
    ContentItem,
    GenerationRequest,
    GreedyStrategy,
    LegacySamplingParams,
    Message,
    ToolCall,
    TopPStrategy,
)
from app.openai.schemas import ChatMessage
from engine.types import RequestOutput, SamplingParams, TokenLogprob

StopReason = Literal["end_of_turn", "end_of_message", "out_of_tokens"]
DeltaStyle = Literal["typed", "bare"]  # 0.1.0+ {"type": "text", "text"} vs 0.0.x bare string

# ---------------------------------------------------------------- request -> engine


def chat_plan(req: ChatCompletionRequest | BatchChatCompletionRequest) -> PlanRequest:
    """A chat request (one conversation, or a batch of them) as the shared request plan's input."""
    params = to_sampling_params(req)
    tools = llama_stack_tools.tools_request(req)
    if isinstance(req, BatchChatCompletionRequest):
        conversations = [chat_messages(m, f"messages_batch[{i}]") for i, m in enumerate(req.messages_batch)]
    else:
        conversations = [chat_messages(req.messages)]
    return PlanRequest(params, "response_format", tools, conversations=conversations)


def completion_plan(req: GenerationRequest, prompt_ids: Sequence[list[int]]) -> PlanRequest:
    """A completion request (its prompts already token ids) as the shared request plan's input."""
    return PlanRequest(to_sampling_params(req), "response_format", prompt_ids=prompt_ids)


def to_sampling_params(req: GenerationRequest) -> SamplingParams:
    """The one legacy Llama Stack request -> SamplingParams conversion (chat, completion and batches)."""
    sp = req.sampling_params
    temperature, top_p, top_k = _strategy(sp)
    return SamplingParams(
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        repetition_penalty=sp.repetition_penalty or 1.0,
        max_tokens=sp.max_tokens or None,
        stop=tuple(s for s in sp.stop or () if s),
        logprobs=req.logprobs.top_k if req.logprobs is not None else None,
        constraint=llama_stack_tools.response_constraint(req),
    )


def _strategy(sp: LegacySamplingParams) -> tuple[float, float, int]:
    """(temperature, top_p, top_k) for either shape of `strategy`."""
    s = sp.strategy
    if s == "greedy" or isinstance(s, GreedyStrategy):
        return 0.0, 1.0, 0
    if isinstance(s, str):  # 0.0.x: the numbers sit beside the bare strategy name
        temperature = 1.0 if sp.temperature is None else sp.temperature
        if s == "top_p":
            return temperature, sp.top_p or 0.95, 0
        return temperature, 1.0, sp.top_k or 0
    if isinstance(s, TopPStrategy):
        return (1.0 if s.temperature is None else s.temperature), s.top_p or 0.95, 0
    return 1.0, 1.0, s.top_k


def content_text(content: Content, param: str) -> str:
    """Text of interleaved content: a string, one item, or a list of items / strings (joined by spaces,
    as the Llama Stack server joined them). Images are refused: the served models read text only."""
    items = content if isinstance(content, list) else [content]
    return " ".join(_item_text(item, param) for item in items)


def _item_text(item: str | ContentItem, param: str) -> str:
    if isinstance(item, str):
        return item
    if item.type != "text" or item.text is None:
        raise BadRequestError(f"Only text content is supported (got type {item.type!r}).", param=param)
    return item.text


def chat_messages(messages: Sequence[Message], param: str = "messages") -> list[ChatMessage]:
    """Legacy messages as the OpenAI-shaped messages the chat template renderer takes.

    Tool results (`tool`, or `ipython` in 0.0.x) become role `tool` with `tool_call_id`; an assistant turn's
    `tool_calls` become OpenAI tool calls (arguments as a JSON string)."""
    out = []
    for i, m in enumerate(messages):
        text = content_text(m.content, f"{param}[{i}].content")
        if m.role in ("tool", "ipython"):
            name = m.tool_name if isinstance(m.tool_name, str) else None
            out.append(ChatMessage(role="tool", content=text, tool_call_id=m.call_id, name=name))
        elif m.role == "assistant" and m.tool_calls:
            calls = [_openai_tool_call(c) for c in m.tool_calls]
            out.append(ChatMessage(role="assistant", content=text, tool_calls=calls))
        else:
            out.append(ChatMessage(role=m.role, content=text))
    return out


def _openai_tool_call(call: ToolCall) -> dict[str, Any]:
    arguments = call.arguments if isinstance(call.arguments, str) else json.dumps(call.arguments)
    name = call.tool_name if isinstance(call.tool_name, str) else json.dumps(call.tool_name)
    return {"id": call.call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


# ---------------------------------------------------------------- engine -> wire


def stop_reason(finish_reason: str | None) -> StopReason:
    return "out_of_tokens" if finish_reason == "length" else "end_of_turn"


def token_logprobs(lps: Sequence[TokenLogprob]) -> list[dict[str, dict[str, float]]]:
    """One `{"logprobs_by_token": {...}}` per generated token: the chosen token and its alternatives."""
    return [{"logprobs_by_token": {t.token: t.logprob, **{a.token: a.logprob for a in t.top}}} for t in lps]


def metrics(prompt_tokens: int, completion_tokens: int) -> list[dict[str, Any]]:
    counts = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens}
    counts["total_tokens"] = prompt_tokens + completion_tokens
    return [{"metric": name, "value": value, "unit": None} for name, value in counts.items()]


@dataclass(slots=True)
class Fold:
    """Everything one sequence produced, for the non-stream responses."""

    want_logprobs: bool
    text: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0

    def add(self, out: RequestOutput) -> None:
        self.text.append(out.text)
        self.logprobs.extend(out.logprobs or ())
        self.finish_reason = out.finish_reason or self.finish_reason
        self.prompt_tokens, self.completion_tokens = out.prompt_tokens, out.completion_tokens

    def _common(self) -> dict[str, Any]:
        return {
            "stop_reason": stop_reason(self.finish_reason),
            "logprobs": token_logprobs(self.logprobs) if self.want_logprobs else None,
            "metrics": metrics(self.prompt_tokens, self.completion_tokens),
        }

    def chat_response(self) -> dict[str, Any]:
        common = self._common()
        message = {
            "role": "assistant",
            "content": "".join(self.text),
            "stop_reason": common.pop("stop_reason"),
        }
        return {"completion_message": message | {"tool_calls": []}, **common}

    def completion_response(self) -> dict[str, Any]:
        return {"content": "".join(self.text), **self._common()}


async def fold_outputs(
    outputs: AsyncIterator[tuple[int, RequestOutput]], count: int, want_logprobs: bool
) -> list[Fold]:
    """Collect `count` prompts' outputs (one sequence each) into one Fold per prompt."""
    folds = [Fold(want_logprobs) for _ in range(count)]
    async for i, out in outputs:
        folds[i].add(out)
    return folds


def _delta(text: str, style: DeltaStyle) -> dict[str, str] | str:
    return {"type": "text", "text": text} if style == "typed" else text


async def chat_events(
    outputs: AsyncIterator[tuple[int, RequestOutput]], style: DeltaStyle, want_logprobs: bool
) -> AsyncIterator[dict[str, Any]]:
    """A chat stream: one `start` event, a `progress` event per text delta, one `complete` event."""

    def event(
        kind: str, text: str, reason: StopReason | None = None, lps: Sequence[TokenLogprob] = ()
    ) -> dict:
        logprobs = token_logprobs(lps) if want_logprobs and lps else None
        body = {"event_type": kind, "delta": _delta(text, style), "stop_reason": reason, "logprobs": logprobs}
        return {"event": body}

    yield event("start", "")
    fold = Fold(want_logprobs=False)
    async for _, out in outputs:
        fold.add(out)
        if out.text or (want_logprobs and out.logprobs):
            yield event("progress", out.text, lps=out.logprobs or ())
    reason = stop_reason(fold.finish_reason)
    yield event("complete", "", reason) | {"metrics": metrics(fold.prompt_tokens, fold.completion_tokens)}


async def completion_events(
    outputs: AsyncIterator[tuple[int, RequestOutput]], want_logprobs: bool
) -> AsyncIterator[dict[str, Any]]:
    """A completion stream: `{"delta", "stop_reason", "logprobs"}` chunks; the last one has the stop reason
    and the token metrics."""
    async for _, out in outputs:
        if not (out.text or out.logprobs or out.finished):
            continue
        chunk: dict[str, Any] = {
            "delta": out.text,
            "stop_reason": stop_reason(out.finish_reason) if out.finished else None,
            "logprobs": token_logprobs(out.logprobs) if want_logprobs and out.logprobs else None,
        }
        if out.finished:
            chunk["metrics"] = metrics(out.prompt_tokens, out.completion_tokens)
        yield chunk
