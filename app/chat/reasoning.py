"""Reasoning output: the thinking a reasoning model writes between `<think>` and `</think>` goes to
`message.reasoning_content` (`delta.reasoning_content` in streams), the rest to `content`, as vLLM's and
llama.cpp's servers do. `reasoning` carries the same text (vLLM's newer name; Llama Stack's remote::vllm
provider reads either).

Parsers (`--reasoning-parser`):
- `deepseek_r1`: the chat template opens `<think>` in the generation prompt (DeepSeek-R1 distills), so the
  answer is reasoning until `</think>`; a `<think>` the model writes itself first is dropped; with no
  `</think>` at all, everything is reasoning.
- `qwen3`: reasoning only when the answer starts with `<think>` (Qwen3, QwQ); else it is all content.
- `auto` (default): on for tokenizers that know the `<think>`/`</think>` tokens or templates that write
  them, off otherwise; per request, `deepseek_r1` when the rendered prompt ends with `<think>`, else `qwen3`.
- `gpt_oss`: gpt-oss's harmony channels (`app/chat/harmony.py`): the analysis channel is reasoning, the final
  channel content, and a call to a function is rewritten for the tool parser; `auto` picks it for a chat
  template that writes the harmony format.
- `none`: off; the markers stay in `content`.
The splitter works on text deltas, holding back a tail that may be the start of a marker, so a marker
split across tokens is never streamed as content.
"""

from __future__ import annotations

import weakref
from collections.abc import AsyncIterator, Callable
from typing import Any, Literal, Protocol

from app.chat.harmony import HarmonySplitter, is_harmony
from app.openai.schemas import ChatCompletionResponse
from engine.core.stopping import partial_stop_len

ReasoningParser = Literal["auto", "none", "deepseek_r1", "qwen3", "gpt_oss"]
START, END = "<think>", "</think>"
Mode = Literal["await", "reasoning", "content"]


class Splitter(Protocol):
    """Splits one choice's streamed text into (reasoning, content) deltas; `flush` gives what it held back."""

    def feed(self, text: str) -> tuple[str, str]: ...

    def flush(self) -> tuple[str, str]: ...


class ReasoningSplitter:
    """Splits one choice's streamed text into (reasoning, content) deltas."""

    def __init__(self, in_reasoning: bool) -> None:
        self._mode: Mode = "reasoning" if in_reasoning else "await"
        self._strip_start = True  # drop a leading <think> (and whitespace) once
        self._buffer = ""
        self._trim_next = in_reasoning  # strip whitespace at the start of the next section

    def feed(self, text: str) -> tuple[str, str]:
        self._buffer += text
        reasoning, content = [], []
        while True:
            progressed = self._step(reasoning, content, final=False)
            if not progressed:
                break
        return "".join(reasoning), "".join(content)

    def flush(self) -> tuple[str, str]:
        reasoning, content = [], []
        while self._step(reasoning, content, final=True):
            pass
        return "".join(reasoning), "".join(content)

    def _step(self, reasoning: list[str], content: list[str], final: bool) -> bool:
        """Consume what can be decided from the buffer; False when it must wait for more text."""
        if not self._buffer:
            return False
        if self._mode == "content":
            content.append(self._trim(self._take(len(self._buffer))))
            return False
        if self._strip_start:
            return self._leading_start(final)
        at = self._buffer.find(END)
        if at >= 0:
            reasoning.append(self._trim(self._take(at)))
            self._take(len(END))
            self._mode, self._trim_next = "content", True
            return True
        keep = 0 if final else partial_stop_len(self._buffer, (END,))
        reasoning.append(self._trim(self._take(len(self._buffer) - keep)))
        return False

    def _leading_start(self, final: bool) -> bool:
        """Before any output: a `<think>` (after whitespace) opens reasoning; other text decides the mode."""
        head = self._buffer.lstrip()
        if head.startswith(START):
            self._buffer = head[len(START):]
            self._strip_start, self._mode, self._trim_next = False, "reasoning", True
            return True
        if (not head or START.startswith(head)) and not final:
            return False  # whitespace, or a prefix of <think>: wait
        self._strip_start = False
        if self._mode == "await":
            self._mode, self._trim_next = "content", False
        return True

    def _take(self, n: int) -> str:
        out, self._buffer = self._buffer[:n], self._buffer[n:]
        return out

    def _trim(self, text: str) -> str:
        if self._trim_next:
            text = text.lstrip()
            self._trim_next = not text
        return text


def parser_enabled(parser: str, tokenizer: Any) -> bool:
    if parser == "none":
        return False
    if parser != "auto":
        return True
    known = _knows_markers.get(tokenizer)
    if known is None:  # once per tokenizer: get_vocab() builds a dict of the vocabulary (~18 ms for SmolLM2's 49k)
        vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
        template = str(getattr(tokenizer, "chat_template", None) or "")
        known = _knows_markers[tokenizer] = (START in vocab and END in vocab) or END in template
    return known


_knows_markers: weakref.WeakKeyDictionary[Any, bool] = weakref.WeakKeyDictionary()


def splitter_factory(parser: str, tokenizer: Any, prompt_ids: list[int]) -> Callable[[], Splitter] | None:
    """Makes one splitter per choice of this request; None when reasoning parsing is off for this model."""
    if parser == "gpt_oss" or (parser == "auto" and is_harmony(getattr(tokenizer, "chat_template", None))):
        return HarmonySplitter
    if not parser_enabled(parser, tokenizer):
        return None
    if parser == "auto":
        tail = tokenizer.decode(prompt_ids[-8:], skip_special_tokens=False)
        in_reasoning = tail.rstrip().endswith(START)
    else:
        in_reasoning = parser == "deepseek_r1"
    return lambda: ReasoningSplitter(in_reasoning)


def split_response(response: ChatCompletionResponse, new_splitter: Callable[[], Splitter]) -> ChatCompletionResponse:
    """Move each choice's reasoning out of `content` (non-stream answers)."""
    for choice in response.choices:
        splitter = new_splitter()
        reasoning, content = splitter.feed(choice.message.content or "")
        more_reasoning, more_content = splitter.flush()
        reasoning, content = reasoning + more_reasoning, content + more_content
        choice.message.content = content
        if reasoning:
            choice.message.reasoning_content = choice.message.reasoning = reasoning
    return response


async def split_chunks(events: AsyncIterator[dict[str, Any]],
                       new_splitter: Callable[[], Splitter]) -> AsyncIterator[dict[str, Any]]:
    """Move reasoning from `delta.content` to `delta.reasoning_content` (and `delta.reasoning`) in chat
    stream chunks, one splitter per choice; what a splitter holds back goes out with the choice's last chunk."""
    splitters: dict[int, Splitter] = {}
    async for event in events:
        for choice in event.get("choices") or []:
            delta, index = choice.get("delta") or {}, choice["index"]
            if delta.get("role"):
                continue
            splitter = splitters.setdefault(index, new_splitter())
            reasoning, content = splitter.feed(delta.pop("content", None) or "")
            if choice.get("finish_reason") is not None:
                tail = splitter.flush()
                reasoning, content = reasoning + tail[0], content + tail[1]
            if content:
                delta["content"] = content
            if reasoning:
                delta["reasoning_content"] = delta["reasoning"] = reasoning
            choice["delta"] = delta
        if not _empty(event):
            yield event


def _empty(event: dict[str, Any]) -> bool:
    """A chunk whose text was all held back or moved: nothing left to send."""
    choices = event.get("choices")
    return bool(choices) and event.get("usage") is None and all(
        not c.get("delta") and c.get("finish_reason") is None and c.get("logprobs") is None for c in choices
    )
