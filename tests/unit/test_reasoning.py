"""app/chat/reasoning.py: <think>...</think> split from content, the same whether streamed in any chunking or not."""

from __future__ import annotations

import asyncio
import random
from typing import Any

import pytest

from app.chat.reasoning import ReasoningSplitter, parser_enabled, split_chunks, splitter_factory

CASES = [  # (in_reasoning: the prompt opened <think>, model output, expected reasoning, expected content)
    (True, "Let me think.</think>\n\nThe answer is 4.", "Let me think.", "The answer is 4."),
    (True, "<think>\nLet me think.\n</think>The answer.", "Let me think.\n", "The answer."),
    (True, "Still thinking, never closed", "Still thinking, never closed", ""),
    (True, "a </b> c </thin", "a </b> c </thin", ""),
    (False, "<think>\nHmm, 2 + 2.\n</think>\n\n4", "Hmm, 2 + 2.\n", "4"),
    (False, "  <think>x</think>y", "x", "y"),
    (False, "Plain answer with <think> inside.", "", "Plain answer with <think> inside."),
    (False, "<thinking is not a marker", "", "<thinking is not a marker"),
    (False, "", "", ""),
    (True, "</think>", "", ""),
]


def run(splitter: ReasoningSplitter, pieces: list[str]) -> tuple[str, str]:
    reasoning, content = "", ""
    for piece in pieces:
        r, c = splitter.feed(piece)
        reasoning, content = reasoning + r, content + c
    r, c = splitter.flush()
    return reasoning + r, content + c


def chunkings(text: str, rng: random.Random) -> list[list[str]]:
    out = [[text], list(text)]
    for _ in range(20):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 6)))) if len(text) > 1 else []
        bounds = [0, *cuts, len(text)]
        out.append([text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)])
    return out


@pytest.mark.parametrize(("in_reasoning", "text", "reasoning", "content"), CASES)
def test_any_chunking_gives_the_same_split(in_reasoning: bool, text: str, reasoning: str, content: str) -> None:
    rng = random.Random(text)
    for pieces in chunkings(text, rng):
        assert run(ReasoningSplitter(in_reasoning), pieces) == (reasoning, content), pieces


def test_a_marker_split_across_deltas_is_never_streamed_as_content() -> None:
    s = ReasoningSplitter(in_reasoning=True)
    assert s.feed("thinking </th") == ("thinking ", "")
    assert s.feed("ink> done") == ("", "done")
    q = ReasoningSplitter(in_reasoning=False)
    assert q.feed("<thi") == ("", "") and q.feed("nk>idea") == ("idea", "")


class Tok:
    def __init__(self, vocab: dict[str, int], template: str | None = None) -> None:
        self.vocab, self.chat_template = vocab, template

    def get_vocab(self) -> dict[str, int]:
        self.vocab_calls = getattr(self, "vocab_calls", 0) + 1
        return self.vocab

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        inverse = {v: k for k, v in self.vocab.items()}
        return "".join(inverse[i] for i in ids)


def test_the_parser_setting_and_auto_detection() -> None:
    knows = Tok({"<think>": 0, "</think>": 1, "a": 2, "\n": 3})
    plain = Tok({"a": 2})
    assert not parser_enabled("auto", plain) and parser_enabled("auto", knows)
    assert not parser_enabled("auto", plain) and parser_enabled("auto", knows)
    assert plain.vocab_calls == knows.vocab_calls == 1  # the vocabulary is looked at once per tokenizer
    assert parser_enabled("auto", Tok({"a": 2}, template="{{ '</think>' }}"))
    assert splitter_factory("none", knows, [2, 0]) is None and splitter_factory("auto", plain, [2]) is None
    assert run(splitter_factory("deepseek_r1", plain, [2])(), ["x</think>y"]) == ("x", "y")
    assert run(splitter_factory("auto", knows, [2, 0, 3])(), ["x</think>y"]) == ("x", "y")  # prompt opened it
    assert run(splitter_factory("auto", knows, [2, 3])(), ["x</think>y"]) == ("", "x</think>y")
    assert run(splitter_factory("qwen3", plain, [2, 0])(), ["<think>x</think>y"]) == ("x", "y")


def test_stream_chunks_carry_reasoning_content_and_drop_empty_deltas() -> None:
    def chunk(index: int, delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
        return {"choices": [{"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}]}

    events = [chunk(0, {"role": "assistant", "content": ""}), chunk(0, {"content": "ab</th"}),
              chunk(0, {"content": "ink>cd"}), chunk(0, {"content": "e"}, "stop")]

    async def collect() -> list[dict[str, Any]]:
        async def source():
            for e in events:
                yield e
        return [e async for e in split_chunks(source(), lambda: ReasoningSplitter(True))]

    out = asyncio.run(collect())
    deltas = [e["choices"][0]["delta"] for e in out]
    assert deltas == [{"role": "assistant", "content": ""}, {"reasoning_content": "ab", "reasoning": "ab"},
                      {"content": "cd"}, {"content": "e"}]
    assert out[-1]["choices"][0]["finish_reason"] == "stop"
