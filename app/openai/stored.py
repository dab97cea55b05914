"""OpenAI's stored chat completions, in the same database as stored responses (`app/store.py`).

`POST /v1/chat/completions` with `store: true` (and optional `metadata`) keeps the completion with its input
messages; `--store-chat-completions` keeps every one a request does not refuse with `store: false` (what Llama
Stack does, and what its `test_inference_store*` suite expects of a server). A stored completion is written,
in one committed transaction, before the client gets it (non-stream: before the body is returned; stream:
before `[DONE]`). Routes: `GET /v1/chat/completions` (list: `model`, `metadata[key]=value`, `after`, `limit`,
`order`), `GET /v1/chat/completions/{id}` (with `input_messages`), `GET /v1/chat/completions/{id}/messages`
(the input messages then the reply, ids `{id}-{i}`), `POST /v1/chat/completions/{id}` (replace `metadata`),
`DELETE /v1/chat/completions/{id}`.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any, Literal

from fastapi import APIRouter, Query, Request
from pydantic import BaseModel, Field

from app.errors import NotFoundError
from app.openai.schemas import ChatCompletionRequest, ChatCompletionResponse
from app.paging import ListPage, list_page, page_after
from app.store import Store, Stored, app_store

router = APIRouter(prefix="/v1", tags=["openai"])
KIND = "chat.completion"


def wanted(request: Request, body: ChatCompletionRequest) -> bool:
    if body.store is not None:
        return body.store
    return bool(getattr(request.app.state.settings, "store_chat_completions", False))


async def remember(request: Request, body: ChatCompletionRequest, response: ChatCompletionResponse) -> None:
    await _put(request, body, response.model_dump(exclude_none=True))


async def remember_stream(request: Request, body: ChatCompletionRequest,
                          events: AsyncIterator[dict[str, Any]]) -> AsyncIterator[dict[str, Any]]:
    """Pass the chunks on and fold them into the completion they make, stored when the stream ends."""
    folded: dict[str, Any] = {}
    async for event in events:
        _fold(folded, event)
        yield event
    if folded:
        await _put(request, body, folded)


def _fold(folded: dict[str, Any], chunk: dict[str, Any]) -> None:
    if not folded:
        folded |= {k: chunk[k] for k in ("id", "created", "model")} | {"object": "chat.completion", "choices": {}}
    for choice in chunk.get("choices") or []:
        into = folded["choices"].setdefault(choice["index"], {"index": choice["index"], "finish_reason": None,
                                                              "message": {"role": "assistant", "content": ""}})
        delta, message = choice.get("delta") or {}, into["message"]
        message["content"] += delta.get("content") or ""
        for call in delta.get("tool_calls") or []:
            calls = message.setdefault("tool_calls", [])
            if call.get("id"):
                calls.append({"id": call["id"], "type": "function",
                              "function": {"name": call["function"]["name"], "arguments": ""}})
            calls[-1]["function"]["arguments"] += (call.get("function") or {}).get("arguments") or ""
        into["finish_reason"] = choice.get("finish_reason") or into["finish_reason"]
    if chunk.get("usage"):
        folded["usage"] = chunk["usage"]


async def _put(request: Request, body: ChatCompletionRequest, completion: dict[str, Any]) -> None:
    if isinstance(completion["choices"], dict):  # folded from a stream
        completion["choices"] = [completion["choices"][i] for i in sorted(completion["choices"])]
    for choice in completion["choices"]:
        if choice["message"].get("tool_calls") and not choice["message"].get("content"):
            choice["message"]["content"] = None
    completion["metadata"] = body.metadata or {}
    inputs = [m.model_dump(exclude_none=True) for m in body.messages]
    stored = Stored(KIND, completion["id"], float(completion["created"]), completion["model"], body.metadata or {},
                    completion, {"input_messages": inputs})
    await app_store(request.app).aput(stored)


# ---------------------------------------------------------------- routes


class MetadataUpdate(BaseModel):
    metadata: dict[str, str] | None = Field(..., description="The new metadata (replaces the old).")


@router.get("/chat/completions", response_model=ListPage)
async def list_chat_completions(
    request: Request, model: str | None = None, after: str | None = None,
    limit: int = Query(20, ge=1, le=1000), order: Literal["asc", "desc"] = "asc",
) -> ListPage:
    """Stored chat completions (OpenAI `GET /v1/chat/completions`), oldest first unless `order=desc`;
    `metadata[key]=value` query parameters filter on metadata."""
    metadata = {k[len("metadata["):-1]: v for k, v in request.query_params.items()
                if k.startswith("metadata[") and k.endswith("]")}
    found = await _run(request, lambda s: s.list(KIND, model=model, metadata=metadata, after=after,
                                                 limit=limit + 1, order=order))
    return list_page([_with_inputs(s) for s in found[:limit]], has_more=len(found) > limit)


@router.get("/chat/completions/{completion_id}")
async def retrieve_chat_completion(completion_id: str, request: Request) -> dict[str, Any]:
    """A stored chat completion, with the `input_messages` it answered."""
    return _with_inputs(await _get(request, completion_id))


@router.get("/chat/completions/{completion_id}/messages", response_model=ListPage)
async def list_chat_completion_messages(
    completion_id: str, request: Request, after: str | None = None,
    limit: int = Query(20, ge=1, le=1000), order: Literal["asc", "desc"] = "asc",
) -> ListPage:
    """The messages of a stored chat completion: its input, then its reply; ids are `{id}-{i}`."""
    stored = await _get(request, completion_id)
    replies = [c["message"] for c in stored.body["choices"][:1]]
    messages = [m | {"id": f"{completion_id}-{i}"} for i, m in enumerate([*stored.extra["input_messages"], *replies])]
    return page_after(messages, order, after, limit)


@router.post("/chat/completions/{completion_id}")
async def update_chat_completion(completion_id: str, update: MetadataUpdate, request: Request) -> dict[str, Any]:
    """Replace a stored chat completion's `metadata`."""
    stored = await _get(request, completion_id)
    metadata = update.metadata or {}
    body = stored.body | {"metadata": metadata}
    await _run(request, lambda s: s.update_metadata(KIND, completion_id, metadata, body))
    return body


@router.delete("/chat/completions/{completion_id}")
async def delete_chat_completion(completion_id: str, request: Request) -> dict[str, Any]:
    """Delete a stored chat completion."""
    if not await _run(request, lambda s: s.delete(KIND, completion_id)):
        raise _not_found(completion_id)
    return {"id": completion_id, "object": "chat.completion.deleted", "deleted": True}


async def _run(request: Request, call: Callable[[Store], Any]) -> Any:
    """`call(store)` off the event loop (SQLite calls block)."""
    return await asyncio.to_thread(call, app_store(request.app))


async def _get(request: Request, completion_id: str) -> Stored:
    found = await app_store(request.app).aget(KIND, completion_id)
    if found is None:
        raise _not_found(completion_id)
    return found


def _with_inputs(stored: Stored) -> dict[str, Any]:
    return stored.body | {"input_messages": stored.extra["input_messages"]}


def _not_found(completion_id: str) -> NotFoundError:
    return NotFoundError(f"No stored chat completion with id {completion_id!r}.", param="completion_id",
                         code="not_found")
