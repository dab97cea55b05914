"""The requests tests/ray/test_ray_serve.py sends through Ray's proxy: greedy asks (answer and replica header),
and long streams of which the first to get a chunk has its replica SIGKILLed."""

from __future__ import annotations

import asyncio
import os
import signal
from dataclasses import dataclass

import openai
import pytest

HEADER = "x-peregrine-replica"
REQUEST_TIMEOUT_S = 240.0  # a request that takes longer than this has hung


async def ask(client: openai.AsyncOpenAI, model: str, kind: str, prompt: str, max_tokens: int) -> str:
    text, _, _ = await ask_raw(client, model, kind, prompt, max_tokens, stream=False)
    return text


async def ask_raw(client, model: str, kind: str, prompt: str, max_tokens: int, stream: bool):
    """One greedy request; returns (text, finish_reason, replica header)."""
    common = {"model": model, "max_tokens": max_tokens, "temperature": 0, "stream": stream,
              "extra_body": {"ignore_eos": True}}  # fmt: skip
    if kind == "chat":
        raw = await client.chat.completions.with_raw_response.create(
            messages=[{"role": "user", "content": prompt}], **common
        )
    else:
        raw = await client.completions.with_raw_response.create(prompt=prompt, **common)
    replica = raw.headers.get(HEADER)
    parsed = await raw.parse() if asyncio.iscoroutinefunction(raw.parse) else raw.parse()
    if not stream:
        choice = parsed.choices[0]
        return (choice.message.content if kind == "chat" else choice.text), choice.finish_reason, replica
    parts, finish = [], None
    async for chunk in parsed:
        if chunk.choices:
            choice = chunk.choices[0]
            parts.append((choice.delta.content if kind == "chat" else choice.text) or "")
            finish = choice.finish_reason or finish
    return "".join(parts), finish, replica


async def timed(coro):
    """A request that does not finish within REQUEST_TIMEOUT_S has hung: fail, do not wait forever."""
    return await asyncio.wait_for(coro, REQUEST_TIMEOUT_S)


@dataclass
class StreamResult:
    replica: str | None
    text: str
    finish_reason: str | None
    chunks: int
    error: BaseException | None
    silent: bool = False  # ended cleanly but without a finish_reason: the failure mode that must not happen


class KillOnFirstChunk:
    """SIGKILLs the replica of the first stream that gets a chunk, inside that stream's chunk loop (so the kill
    lands before the loop reads any further), and remembers which stream and replica that was."""

    def __init__(self, replicas: dict[str, int]) -> None:
        self.replicas = replicas
        self.trigger: StreamResult | None = None
        self._killed = asyncio.Event()

    def on_chunk(self, result: StreamResult) -> None:
        if self.trigger is None:
            self.trigger = result
            os.kill(self.replicas[result.replica], signal.SIGKILL)
            self._killed.set()

    async def victim(self) -> str:
        await asyncio.wait_for(self._killed.wait(), timeout=REQUEST_TIMEOUT_S)
        return self.trigger.replica


async def long_stream(
    client, model: str, prompt: str, max_tokens: int, killer: KillOnFirstChunk
) -> StreamResult:
    result = StreamResult(None, "", None, 0, None)
    try:
        await timed(consume(client, model, prompt, max_tokens, killer, result))
    except TimeoutError:
        pytest.fail(f"a stream hung: {result}")
    except Exception as exc:  # an error is an answer; a clean end without a finish_reason is not
        result.error = exc
    return result


async def consume(
    client, model, prompt, max_tokens, killer: KillOnFirstChunk, result: StreamResult
) -> None:
    raw = await client.completions.with_raw_response.create(
        model=model, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True,
        extra_body={"ignore_eos": True})  # fmt: skip
    result.replica = raw.headers.get(HEADER)
    parsed = await raw.parse() if asyncio.iscoroutinefunction(raw.parse) else raw.parse()
    async for chunk in parsed:
        result.chunks += 1
        killer.on_chunk(result)
        if chunk.choices:
            result.text += chunk.choices[0].text or ""
            result.finish_reason = chunk.choices[0].finish_reason or result.finish_reason
    result.silent = result.finish_reason is None


async def outcome(coro):
    """The result, or the openai error it raised; a hang fails the test."""
    try:
        return await timed(coro)
    except TimeoutError:
        pytest.fail("a request hung")
    except openai.APIError as exc:
        return exc
