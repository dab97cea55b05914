"""The one place `app/` runs engine requests: one engine request per prompt, merged, closed on exit.

Every API family (OpenAI, Llama Stack) turns its wire request into token ids + `SamplingParams` and calls
`generate`, before any byte of a response is sent: the engine checks each prompt and the params there, once
(context overflow is a clean 400, its `param` mapped to the family's wire field). Leaving the iteration early
for any reason (client gone, timeout, error, shutdown) closes the engine's iterators, and the engine aborts the
requests that have not finished (`AsyncEngine.generate`: the one abort), so their KV memory is freed at once.
Client disconnects and timeouts are watched in one place, the limits middleware (app/limits.py), which cancels
the route.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence

from app.deps import Engine
from app.errors import EngineFailureError, ServiceUnavailableError
from app.metrics import start_timer
from engine.types import InvalidRequestError, PromptTooLongError, RequestOutput, SamplingParams


def generate(
    engine: Engine, prompts: Sequence[list[int]], params: SamplingParams, request_id: str, prompt_param: str
) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(prompt index, output) as the engine produces them. Raises at once (a 400) when a prompt does not fit or
    is invalid; `prompt_param` is the wire field holding the prompts ("messages", "prompt", ...).

    An output that ends in "error" or an unexpected "abort" (the server is stopping) is raised as an
    APIError instead of being yielded, so converters only ever see "stop" and "length".
    """
    ids = [request_id] if len(prompts) == 1 else [f"{request_id}-{i}" for i in range(len(prompts))]
    try:
        streams = [engine.generate(list(p), params, rid) for p, rid in zip(prompts, ids, strict=True)]
    except (PromptTooLongError, InvalidRequestError) as exc:
        if exc.param == "prompt_token_ids":
            exc.param = prompt_param
        elif exc.param == "constraint":
            exc.param = "response_format"
        raise
    return _outputs(streams, prompts)


async def _outputs(
    streams: list[AsyncIterator[RequestOutput]], prompts: Sequence[list[int]]
) -> AsyncIterator[tuple[int, RequestOutput]]:
    timer = start_timer(len(p) for p in prompts)  # TTFT / TPOT / e2e and token counts for GET /metrics
    try:
        async with contextlib.aclosing(_merge(streams)) as merged:
            async for i, out in merged:
                timer.on_output(i, out)
                _raise_if_failed(out)
                yield i, out
    finally:
        timer.close()


def _raise_if_failed(out: RequestOutput) -> None:
    if out.finish_reason == "error":
        raise EngineFailureError(f"Generation failed: {out.error or 'engine error'}", code="engine_error")
    if out.finish_reason == "abort":
        raise ServiceUnavailableError("The request was aborted by the server (it is shutting down).")


async def _merge(streams: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave the prompts' streams; closing this closes each of them (which aborts what is unfinished)."""
    if len(streams) == 1:  # the common case: no tasks, no queue
        async with contextlib.aclosing(streams[0]) as outs:  # type: ignore[type-var]
            async for out in outs:
                yield 0, out
        return
    queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

    async def pump(i: int) -> None:
        try:
            async with contextlib.aclosing(streams[i]) as outs:  # type: ignore[type-var]
                async for out in outs:
                    await queue.put((i, out))
            await queue.put((i, None))
        except Exception as exc:  # noqa: BLE001 - handed to the consumer, which re-raises it
            await queue.put((i, exc))

    tasks = [asyncio.ensure_future(pump(i)) for i in range(len(streams))]
    try:
        running = len(tasks)
        while running:
            i, item = await queue.get()
            if item is None:
                running -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(*tasks, return_exceptions=True)
