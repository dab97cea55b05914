"""The benchmark's client: one streamed OpenAI request, timed chunk by chunk, and the load generators
(a fixed number of concurrent streams, or Poisson arrivals at a request rate).

The client is aiohttp, as in vLLM's serving benchmark: its C line parser costs about a third of the CPU
httpx (pure-Python h11) spends per streamed chunk, and on a 2-core machine every cycle the load generator
takes is a cycle the server under test does not get (docs/benchmarks.md, "The load generator").

Each server family asks for a fixed output length in its own way (`FIXED_LENGTH`): vLLM's extension
`ignore_eos` (Peregrine, vLLM, llama.cpp's llama-server), `min_tokens` (llama-cpp-python's server), a
`generation_config` JSON with `min_new_tokens` (`transformers serve`). Sampling is greedy everywhere.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp
from bench_datasets import BenchRequest, count_tokens
from bench_metrics import RequestResult


def _gen_config(n: int, special: Sequence[int]) -> dict[str, Any]:
    return {"generation_config": json.dumps({"max_new_tokens": n, "min_new_tokens": n, "do_sample": False})}


def _min_tokens(n: int, special: Sequence[int]) -> dict[str, Any]:
    """llama-cpp-python's min_tokens only holds back `eos`; its generation also ends on any other
    end-of-generation token (`<|endoftext|>`), so the special tokens are biased away as well."""
    return {"min_tokens": n} | ({"logit_bias": {str(i): -100.0 for i in special}} if special else {})


FIXED_LENGTH: dict[str, Callable[[int, Sequence[int]], dict[str, Any]]] = {
    "ignore_eos": lambda n, special: {"ignore_eos": True},
    "min_tokens": _min_tokens,
    "generation_config": _gen_config,
    "none": lambda n, special: {},
}
USAGE_OPTION = {"stream_options": {"include_usage": True}}


@dataclass(frozen=True, slots=True)
class Target:
    """Where and how to send requests."""

    base_url: str  # the server root, without /v1
    model: str
    fixed_length: str = "ignore_eos"  # a key of FIXED_LENGTH
    stream_options: bool = True  # servers that reject `stream_options` get usage in the last chunk anyway
    api_key: str | None = None
    timeout_s: float = 1800.0
    special_token_ids: tuple[int, ...] = ()  # biased away where EOS alone cannot be ignored
    sampling: tuple[tuple[str, float], ...] = (("temperature", 0.0),)  # body fields: greedy unless told otherwise


def request_body(target: Target, req: BenchRequest) -> tuple[str, dict[str, Any]]:
    """(path, JSON body) of one streamed request (greedy unless `target.sampling` says otherwise) asking for
    exactly `req.output_len` tokens."""
    body: dict[str, Any] = {"model": target.model, "max_tokens": req.output_len, **dict(target.sampling),
                            "stream": True}  # fmt: skip
    body |= FIXED_LENGTH[target.fixed_length](req.output_len, target.special_token_ids)
    if target.stream_options:
        body |= USAGE_OPTION
    if req.kind == "chat":
        return "/v1/chat/completions", body | {"messages": list(req.messages or ())}
    return "/v1/completions", body | {"prompt": req.prompt}


def chunk_text(event: dict[str, Any]) -> str:
    choices = event.get("choices") or []
    if not choices:
        return ""
    choice = choices[0]
    return choice.get("text") or (choice.get("delta") or {}).get("content") or ""


async def send(
    session: aiohttp.ClientSession, target: Target, req: BenchRequest, tokenizer: Any
) -> RequestResult:
    """Send one request and time its stream. Never raises: failures come back as `success=False`."""
    path, body = request_body(target, req)
    headers = {"Authorization": f"Bearer {target.api_key}"} if target.api_key else {}
    result = RequestResult(prompt_tokens=req.prompt_tokens)
    start = time.perf_counter()
    try:
        async with session.post(target.base_url + path, json=body, headers=headers) as response:
            if response.status != 200:
                text = (await response.read()).decode(errors="replace")
                result.error = f"HTTP {response.status}: {text[:200]}"
                return result
            usage = await _read_stream(response.content, result, start)
    except (TimeoutError, aiohttp.ClientError, ValueError, OSError) as exc:  # ValueError: bad JSON
        result.error = f"{type(exc).__name__}: {exc}"[:300]
        return result
    result.latency = time.perf_counter() - start
    _settle_counts(result, usage, tokenizer)
    return result


async def _read_stream(lines: AsyncIterator[bytes], result: RequestResult, start: float) -> dict[str, Any]:
    usage: dict[str, Any] = {}
    pieces: list[str] = []
    last = start
    async for line in lines:
        if not line.startswith(b"data:"):
            continue
        payload = line[5:].strip()
        if payload == b"[DONE]":
            break
        event = json.loads(payload)
        if "error" in event:
            result.error = f"stream error: {json.dumps(event['error'])[:200]}"
            return usage
        usage = event.get("usage") or usage
        if text := chunk_text(event):
            now = time.perf_counter()
            if pieces:
                result.itl.append(now - last)
            else:
                result.ttft = now - start
            pieces.append(text)
            last = now
    result.text = "".join(pieces)
    result.success = bool(pieces)
    if not pieces:
        result.error = "empty stream: no generated text"
    return usage


def _settle_counts(result: RequestResult, usage: dict[str, Any], tokenizer: Any) -> None:
    """Token counts from the server's usage when it reports them, else from the local tokenizer."""
    if usage.get("completion_tokens"):
        result.output_tokens = int(usage["completion_tokens"])
    elif result.text:
        result.output_tokens = count_tokens(tokenizer, result.text)
    if usage.get("prompt_tokens"):
        result.prompt_tokens = int(usage["prompt_tokens"])


def arrival_gaps(count: int, rate: float | None, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Seconds to wait before each request: 0 for rate None (all at once, bounded by concurrency),
    else gamma-distributed gaps with mean 1/rate (burstiness 1 = Poisson), as vLLM draws them."""
    if rate is None or rate == float("inf"):
        return [0.0] * count
    rng = random.Random(seed)
    theta = 1.0 / (rate * burstiness)
    return [rng.gammavariate(burstiness, theta) for _ in range(count)]


async def run_load(
    target: Target,
    requests: Sequence[BenchRequest],
    tokenizer: Any,
    concurrency: int | None,
    rate: float | None = None,
    burstiness: float = 1.0,
    seed: int = 0,
) -> tuple[list[RequestResult], float]:
    """Send every request (at most `concurrency` in flight, arriving at `rate`/s if given).
    Returns the results in request order and the run's duration (first send to last completion)."""
    limit = concurrency or len(requests)
    semaphore = asyncio.Semaphore(limit)
    # A new connection per request, for every server alike: a pooled keep-alive connection that the server has
    # closed meanwhile fails the next request ("Can not write request body", seen with llama-server).
    connector = aiohttp.TCPConnector(force_close=True, limit=limit + 4)
    timeout = aiohttp.ClientTimeout(total=target.timeout_s, connect=30.0)
    # read_bufsize bounds one line: a final chunk carrying a whole text must still fit
    async with aiohttp.ClientSession(connector=connector, timeout=timeout, read_bufsize=2**20) as session:

        async def one(req: BenchRequest) -> RequestResult:
            async with semaphore:
                return await send(session, target, req, tokenizer)

        tasks: list[asyncio.Task[RequestResult]] = []
        start = time.perf_counter()
        for req, gap in zip(requests, arrival_gaps(len(requests), rate, burstiness, seed), strict=True):
            if gap:
                await asyncio.sleep(gap)
            tasks.append(asyncio.create_task(one(req)))
        results = list(await asyncio.gather(*tasks))
    return results, time.perf_counter() - start
