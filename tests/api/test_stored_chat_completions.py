"""OpenAI's stored chat completions through a real server and the real `openai` SDK: `store: true` with
`metadata` (stream and not), list with model / metadata filters and paging, retrieve with `input_messages`,
the messages list (as Llama Stack's `test_inference_store` reads it), metadata update, delete; plus the fields
real clients send on chat completions (Llama Stack's Responses layer) never being a 400."""

from __future__ import annotations

import uuid

import httpx
import openai
import pytest

pytestmark = pytest.mark.slow


def _create(client: openai.OpenAI, model_id: str, stream: bool, tag: str) -> tuple[str, str]:
    """(id, content) of a stored completion tagged with `tag` in its metadata."""
    kwargs = dict(model=model_id, messages=[{"role": "user", "content": "Hello, world!"}], max_tokens=6,
                  store=True, metadata={"tag": tag, "stream": str(stream)})
    if not stream:
        response = client.chat.completions.create(**kwargs)
        return response.id, response.choices[0].message.content or ""
    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    return chunks[0].id, "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_store_retrieve_messages_update_delete(client: openai.OpenAI, model_id: str, stream: bool) -> None:
    tag = uuid.uuid4().hex
    completion_id, content = _create(client, model_id, stream, tag)
    listed = client.chat.completions.list(metadata={"tag": tag}, model=model_id)
    assert [c.id for c in listed.data] == [completion_id]
    retrieved = client.chat.completions.retrieve(completion_id)
    assert retrieved.choices[0].message.content == content and retrieved.metadata == {"tag": tag,
                                                                                      "stream": str(stream)}
    assert retrieved.model_extra["input_messages"][0]["content"] == "Hello, world!"
    first = client.chat.completions.messages.list(completion_id=completion_id, limit=1)
    assert [m.id for m in first.data] == [f"{completion_id}-0"] and first.data[0].role == "user"
    assert first.has_more and first.first_id == first.last_id == f"{completion_id}-0"
    second = client.chat.completions.messages.list(completion_id=completion_id, after=first.last_id, limit=10)
    assert [m.id for m in second.data] == [f"{completion_id}-1"] and second.data[0].role == "assistant"
    assert not second.has_more
    updated = client.chat.completions.update(completion_id, metadata={"tag": tag, "seen": "yes"})
    assert updated.metadata == {"tag": tag, "seen": "yes"}
    assert [c.id for c in client.chat.completions.list(metadata={"seen": "yes", "tag": tag}).data] == [completion_id]
    assert client.chat.completions.delete(completion_id).deleted
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.retrieve(completion_id)


def test_list_pages_in_order(client: openai.OpenAI, model_id: str) -> None:
    tag = uuid.uuid4().hex
    ids = [_create(client, model_id, False, tag)[0] for _ in range(3)]
    first = client.chat.completions.list(metadata={"tag": tag}, limit=2)
    assert [c.id for c in first.data] == ids[:2] and first.has_more
    rest = client.chat.completions.list(metadata={"tag": tag}, limit=2, after=first.data[-1].id)
    assert [c.id for c in rest.data] == ids[2:] and not rest.has_more
    newest = client.chat.completions.list(metadata={"tag": tag}, order="desc", limit=1)
    assert [c.id for c in newest.data] == ids[-1:]


def test_not_stored_by_default(client: openai.OpenAI, model_id: str) -> None:
    response = client.chat.completions.create(model=model_id, messages=[{"role": "user", "content": "Hi"}],
                                              max_tokens=2)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.retrieve(response.id)


def test_fields_real_clients_send_are_accepted(http: httpx.Client, model_id: str) -> None:
    """Llama Stack's Responses layer sends these on chat completions: none may be a 400."""
    body = {
        "model": model_id, "messages": [{"role": "user", "content": "Hi"}], "max_completion_tokens": 3,
        "prompt_cache_key": "conversation-1", "safety_identifier": "user-1", "service_tier": "auto",
        "reasoning_effort": "low", "parallel_tool_calls": True, "stream_options": {"include_usage": True},
        "stream": True, "user": "u",
    }
    with http.stream("POST", "/v1/chat/completions", json=body) as response:
        text = response.read().decode()
    assert response.status_code == 200, text
    assert '"usage":{"prompt_tokens"' in text and text.rstrip().endswith("data: [DONE]")


def test_unknown_and_bad_requests(http: httpx.Client) -> None:
    for method, path in [("GET", "/v1/chat/completions/chatcmpl-nope"),
                         ("GET", "/v1/chat/completions/chatcmpl-nope/messages"),
                         ("DELETE", "/v1/chat/completions/chatcmpl-nope")]:
        response = http.request(method, path)
        assert response.status_code == 404 and response.json()["error"]["type"] == "not_found_error"
    bad = http.post("/v1/chat/completions/chatcmpl-nope", json={"metadata": {"a": 1}})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "metadata"
    assert http.get("/v1/chat/completions", params={"limit": 0}).status_code == 400
