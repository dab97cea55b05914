"""The one place `app/` runs engine requests: prompt checks, fan-out over prompts, abort on exit.

Every API family (OpenAI, Llama Stack) turns its wire request into token ids + `SamplingParams`, then
calls `check_prompts` (before any byte of a response is sent, so context overflow is a clean 400) and
iterates `generate`. Leaving the iteration early for any reason (client gone, error, shutdown) aborts the
engine requests that have not finished, so their KV memory is freed at once.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Coroutine, Sequence
from typing import Any

from starlette.requests import Request

from app.errors import APIError, EngineFailureError, ServiceUnavailableError
from app.metrics import start_timer
from engine.types import PromptTooLongError, RequestOutput, SamplingParams


def check_prompts(
    engine, prompts: Sequence[Sequence[int]], params: SamplingParams, prompt_param: str
) -> None:
    """Raise PromptTooLongError (a 400) if a prompt does not fit; `prompt_param` names the wire field."""
    for ids in prompts:
        try:
            engine.check_prompt(len(ids), params.max_tokens)
        except PromptTooLongError as exc:
            param = prompt_param if exc.param in ("prompt", "messages") else exc.param
            raise PromptTooLongError(
                str(exc), prompt_tokens=exc.prompt_tokens, max_model_len=exc.max_model_len, param=param
            ) from None


async def generate(
    engine, prompts: Sequence[list[int]], params: SamplingParams, request_id: str
) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Yield (prompt index, output) as the engine produces them, one engine request per prompt.

    An output that ends in "error" or an unexpected "abort" (the server is stopping) is raised as an
    APIError instead of being yielded, so converters only ever see "stop" and "length".
    """
    ids = [request_id] if len(prompts) == 1 else [f"{request_id}-{i}" for i in range(len(prompts))]
    unfinished: dict[str, int] = {rid: params.n for rid in ids}
    timer = start_timer(len(p) for p in prompts)  # TTFT / TPOT / e2e and token counts for GET /metrics
    try:
        async for i, out in _merge(engine, prompts, params, ids):
            timer.on_output(i, out)
            _raise_if_failed(out)
            if out.finished:
                unfinished[ids[i]] -= 1
            yield i, out
    finally:
        timer.close()
        for rid, left in unfinished.items():
            if left > 0:
                engine.abort(rid)


class ClientDisconnectedError(APIError):
    status_code = 499  # nginx's "client closed request": nobody reads it, but logs show why
    error_type = "client_disconnected"


async def until_disconnected(request: Request, work: Coroutine[Any, Any, None]) -> None:
    """Run `work` (a non-stream request's collection loop), cancelling it if the client leaves first.

    The cancellation closes the `generate` iterator inside `work`, which aborts the engine request.
    The body has been read by then, so the next ASGI message can only be `http.disconnect`.
    """
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    if task.cancelled():
        raise ClientDisconnectedError("The client disconnected before the answer was ready.")
    task.result()


async def _wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _raise_if_failed(out: RequestOutput) -> None:
    if out.finish_reason == "error":
        raise EngineFailureError(f"Generation failed: {out.error or 'engine error'}", code="engine_error")
    if out.finish_reason == "abort":
        raise ServiceUnavailableError("The request was aborted by the server (it is shutting down).")


async def _merge(
    engine, prompts: Sequence[list[int]], params: SamplingParams, ids: Sequence[str]
) -> AsyncIterator[tuple[int, RequestOutput]]:
    if len(prompts) == 1:  # the common case: no tasks, no queue
        async for out in engine.generate(prompts[0], params, ids[0]):
            yield 0, out
        return
    queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

    async def pump(i: int) -> None:
        try:
            async for out in engine.generate(prompts[i], params, ids[i]):
                await queue.put((i, out))
            await queue.put((i, None))
        except Exception as exc:  # noqa: BLE001 - handed to the consumer, which re-raises it
            await queue.put((i, exc))

    tasks = [asyncio.ensure_future(pump(i)) for i in range(len(prompts))]
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
