"""The Responses API routes: `POST /v1/responses`, `GET` / `DELETE /v1/responses/{id}`,
`GET /v1/responses/{id}/input_items`.

A turn: look up the conversation it continues (`previous_response_id`, from the store), convert the request to
the chat form (`convert.py`), run it through the chat pipeline (`pipeline.py`), fold the chunks into the
response and its stream events (`events.py`), store it (`app/store.py`) and only then acknowledge it (return
it, or send `response.completed`). Errors use OpenAI's envelope (`app/errors.py`); once a stream has started
they go out as `response.failed`.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse, Response

from app.deps import generates, generation_defaults, request_id
from app.errors import APIError, BadRequestError, NotFoundError, classify
from app.paging import ListPage, page_after
from app.responses import pipeline
from app.responses.convert import Turn, new_id, output_messages, to_turn
from app.responses.events import ResponseBuilder, response_base
from app.responses.schemas import DeletedResponse, ResponsesRequest
from app.store import Store, Stored, app_store
from app.streaming import StreamFormat, stream_response
from engine.types import EngineError

router = APIRouter(prefix="/v1", tags=["responses"])
KIND = "response"


@dataclass(frozen=True, slots=True)
class _EventStream(StreamFormat):
    """OpenAI's framing of Responses streams: `event: <type>` before each `data:` line, no `[DONE]`."""

    def encode(self, event: Mapping[str, Any]) -> bytes:
        data = json.dumps(event, ensure_ascii=False, separators=(",", ":"))
        return f"event: {event.get('type', 'error')}\ndata: {data}\n\n".encode()


EVENT_STREAM = _EventStream("sse", done_marker=False)


@router.post("/responses")
@generates
async def create_response(body: ResponsesRequest, request: Request) -> Response:
    """Create a model response (OpenAI `POST /v1/responses`).

    `input` is a string or a list of items (messages with `input_text` parts, `function_call` and
    `function_call_output` items); `instructions` is this turn's system message. Function `tools` with
    `tool_choice` (`none`, `auto`, `required`, `{type: function, name}`), `text.format` (`json_object`,
    `json_schema`), `max_output_tokens`, `temperature`, `top_p`, `seed` and vLLM's extra sampling keys are served;
    hosted tools (`web_search`, ...) and images are a 400. A reasoning model's thinking comes back as a
    `reasoning` item. `store` (default true) keeps the response (GET, DELETE, `previous_response_id`) in the
    server's SQLite store; `previous_response_id` continues a stored conversation of the same model.
    `stream: true` sends OpenAI's events (`response.created` ... `response.completed`) with `sequence_number`s.
    """
    store = app_store(request.app)
    previous = await _previous(store, body.previous_response_id)
    turn = to_turn(body, previous.extra["messages"] if previous else [])
    engine, model = await pipeline.resolve(request, body.model, body.keep_alive)
    if previous is not None and previous.model != model:
        raise BadRequestError(
            f"previous_response_id {previous.id!r} was answered by the model {previous.model!r}, not {model!r}.",
            param="previous_response_id",
        )
    chunks = await pipeline.chat_chunks(request, engine, model, turn.chat, keep=body.store)
    builder = ResponseBuilder(response_base(new_id("resp"), model, body, defaults=generation_defaults(request)))

    async def save(response: dict[str, Any]) -> None:
        if body.store:
            await store.aput(_stored(response, turn))

    if body.stream:
        return stream_response(_events(builder, chunks, save), EVENT_STREAM, request_id=request_id(request))
    async with contextlib.aclosing(chunks):  # type: ignore[type-var]
        async for chunk in chunks:
            builder.feed(chunk)
    builder.finish()
    assert builder.result is not None  # set by finish()
    await save(builder.result)
    return JSONResponse(builder.result)


async def _previous(store: Store, response_id: str | None) -> Stored | None:
    if response_id is None:
        return None
    found = await store.aget(KIND, response_id)
    if found is None:
        raise NotFoundError(f"No stored response with id {response_id!r} (it may have been deleted or expired, "
                            "or was created with store: false).", param="previous_response_id",
                            code="response_not_found")
    return found


def _stored(response: dict[str, Any], turn: Turn) -> Stored:
    messages = [*turn.history, *output_messages(response["output"])]
    return Stored(KIND, response["id"], float(response["created_at"]), response["model"], response["metadata"],
                  response, {"messages": messages, "input_items": turn.input_items})


async def _events(builder: ResponseBuilder, chunks: AsyncIterator[dict[str, Any]],
                  save: Callable[[dict[str, Any]], Awaitable[None]]) -> AsyncIterator[dict[str, Any]]:
    """The stream: lifecycle and item events; the response is stored before `response.completed` goes out."""
    for event in builder.start():
        yield event
    try:
        async with contextlib.aclosing(chunks):  # type: ignore[type-var]
            async for chunk in chunks:
                for event in builder.feed(chunk):
                    yield event
        closing = builder.finish()
        assert builder.result is not None  # set by finish()
        await save(builder.result)
    except (APIError, EngineError) as exc:
        _, envelope = classify(exc)
        for event in builder.failed(envelope["error"]["message"], str(envelope["error"]["code"] or "server_error")):
            yield event
        return
    for event in closing:
        yield event


@router.get("/responses/{response_id}")
async def retrieve_response(response_id: str, request: Request) -> JSONResponse:
    """A stored response (OpenAI `GET /v1/responses/{id}`); 404 when there is none."""
    return JSONResponse((await _get(request, response_id)).body)


@router.delete("/responses/{response_id}", response_model=DeletedResponse)
async def delete_response(response_id: str, request: Request) -> DeletedResponse:
    """Delete a stored response (OpenAI `DELETE /v1/responses/{id}`); it can no longer be continued."""
    if not await app_store(request.app).adelete(KIND, response_id):
        raise _not_found(response_id)
    return DeletedResponse(id=response_id)


@router.get("/responses/{response_id}/input_items", response_model=ListPage)
async def list_input_items(
    response_id: str,
    request: Request,
    after: str | None = None,
    limit: int = Query(20, ge=1, le=100),
    order: Literal["asc", "desc"] = "desc",
) -> ListPage:
    """The input items of a stored response's turn (OpenAI `GET /v1/responses/{id}/input_items`), newest first
    unless `order=asc`; `after` (an item id) and `limit` page through them."""
    items = list((await _get(request, response_id)).extra["input_items"])
    return page_after(items, order, after, limit)


async def _get(request: Request, response_id: str) -> Stored:
    found = await app_store(request.app).aget(KIND, response_id)
    if found is None:
        raise _not_found(response_id)
    return found


def _not_found(response_id: str) -> NotFoundError:
    return NotFoundError(f"No stored response with id {response_id!r}.", param="response_id",
                         code="response_not_found")
