"""gpt-oss's harmony format: the answer is a series of messages on channels, each written

    <|channel|>CHANNEL[ to=RECIPIENT][ <|constrain|>json]<|message|>BODY<|end|>   (or <|call|>, <|return|>)

after the generation prompt's `<|start|>assistant` (a later message opens with `<|start|>assistant` again, and the
recipient may stand in the role header instead: `<|start|>assistant to=functions.NAME<|channel|>commentary json`).
`analysis` is the model's reasoning, `final` the answer, `commentary` either a preamble for the user or, addressed
`to=functions.NAME`, a call of that tool with the body as its JSON arguments (one call a turn: `<|call|>` ends it).

`HarmonySplitter` reads that text as the reasoning splitter of the chat routes (`app/chat/reasoning.py`): analysis
bodies go to reasoning, final and commentary bodies to content, and a call goes to content in the Hermes form
(`<tool_call>\\n{"name": NAME, "arguments": BODY}\\n</tool_call>`), which the `harmony` tool format reads back
(`app/chat/tool_parsers.py`). So every API family gets reasoning, content and tool calls out of harmony text
through the same two layers as any other model. The markers are special tokens of gpt-oss's vocabulary, so chat
requests to a model with a harmony template keep special tokens in the text (`app/chat/plan.py`).

Text that does not open with a harmony header (a model that ignores the format) is content as it is.
"""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator
from dataclasses import replace

from engine.core.stopping import partial_stop_len
from engine.types import RequestOutput

CHANNEL, MESSAGE, START, CONSTRAIN = "<|channel|>", "<|message|>", "<|start|>", "<|constrain|>"
ENDS = ("<|end|>", "<|call|>", "<|return|>")  # a message's end: <|call|> after a call, <|return|> after the answer
STOP_TOKENS = ("<|call|>", "<|return|>")  # end a turn (gpt-oss's generation config has them as EOS ids)
_BODY_MARKERS = (*ENDS, START, CHANNEL)  # a body ends at these (the last two: a header without an end first)
_HEADER_OPENERS = (CHANNEL, START, MESSAGE, "to=", *ENDS)
_RECIPIENT = re.compile(r"to=([^\s<]+)")
_CHANNEL_NAME = re.compile(re.escape(CHANNEL) + r"\s*(\w+)")
CALL_OPEN, CALL_CLOSE = "<tool_call>\n", "}\n</tool_call>"


def is_harmony(template: str | None) -> bool:
    """Whether a chat template writes the harmony format (gpt-oss's)."""
    return bool(template) and CHANNEL in template and MESSAGE in template  # type: ignore[operator]


class HarmonySplitter:
    """One choice's harmony text, fed in deltas, as (reasoning, content) deltas (the module docstring)."""

    def __init__(self) -> None:
        self._buffer = ""
        self._mode = "start"  # start (undecided), header, body, plain (not harmony)
        self._kind = ""  # the body's: reasoning, content or call
        self._opened = False  # a header was whole at least once

    def feed(self, text: str) -> tuple[str, str]:
        self._buffer += text
        return self._run(final=False)

    def flush(self) -> tuple[str, str]:
        return self._run(final=True)

    def _run(self, final: bool) -> tuple[str, str]:
        reasoning: list[str] = []
        content: list[str] = []
        while self._step(reasoning, content, final):
            pass
        return "".join(reasoning), "".join(content)

    def _step(self, reasoning: list[str], content: list[str], final: bool) -> bool:
        """Consume what the buffer decides; False when it must wait for more text (or, `final`, is done)."""
        if self._mode == "start":
            head = self._buffer.lstrip()
            if any(head.startswith(o) for o in _HEADER_OPENERS):
                self._mode = "header"
                return True
            if not final and (not head or any(o.startswith(head) for o in _HEADER_OPENERS)):
                return False
            self._mode = "plain"
        if self._mode == "plain":
            content.append(self._take(len(self._buffer)))
            return False
        if self._mode == "header":
            at = self._buffer.find(MESSAGE)
            if at < 0:
                if final:  # a header the model never finished: nothing to show, unless it was not harmony at all
                    text = self._take(len(self._buffer))
                    if not self._opened:
                        content.append(text)
                return False
            self._open(self._take(at), content)
            self._take(len(MESSAGE))
            return True
        ends = [(at, marker) for marker in _BODY_MARKERS if (at := self._buffer.find(marker)) >= 0]
        if ends:
            at, marker = min(ends)
            self._emit(self._take(at), reasoning, content)
            self._close(content)
            if marker in ENDS:
                self._take(len(marker))
            return True
        keep = 0 if final else partial_stop_len(self._buffer, _BODY_MARKERS)
        self._emit(self._take(len(self._buffer) - keep), reasoning, content)
        if final:
            self._close(content)
        return False

    def _open(self, header: str, content: list[str]) -> None:
        """A message's header is whole: what its body is."""
        self._opened = True
        recipient = _RECIPIENT.search(header)
        channel = _CHANNEL_NAME.search(header)
        target = recipient.group(1) if recipient else ""
        if target.startswith("functions."):
            self._kind = "call"
            name = target.removeprefix("functions.")
            content.append(f'{CALL_OPEN}{{"name": {json.dumps(name)}, "arguments": ')
        elif channel is not None and channel.group(1) == "analysis":
            self._kind = "reasoning"
        else:
            self._kind = "content"  # final, or commentary for the user
        self._mode = "body"

    def _emit(self, text: str, reasoning: list[str], content: list[str]) -> None:
        (reasoning if self._kind == "reasoning" else content).append(text)

    def _close(self, content: list[str]) -> None:
        if self._mode == "body" and self._kind == "call":
            content.append(CALL_CLOSE)
        self._mode, self._kind = "header", ""

    def _take(self, n: int) -> str:
        out, self._buffer = self._buffer[:n], self._buffer[n:]
        return out


def split(text: str) -> tuple[str, str]:
    """A whole answer's (reasoning, content)."""
    splitter = HarmonySplitter()
    reasoning, content = splitter.feed(text)
    more_reasoning, more_content = splitter.flush()
    return reasoning + more_reasoning, content + more_content


async def content_only(outputs: AsyncIterator[tuple[int, RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """The outputs of a harmony chat for an API without a reasoning field (the legacy Llama Stack routes): each
    choice's text as its content, the reasoning dropped, a call in the Hermes form the tool parser reads."""
    splitters: dict[tuple[int, int], HarmonySplitter] = {}
    async for p, out in outputs:
        splitter = splitters.setdefault((p, out.index), HarmonySplitter())
        _, text = splitter.feed(out.text)
        if out.finish_reason is not None:
            text += splitter.flush()[1]
        yield p, replace(out, text=text)
