"""Bad input gets a clear 4xx in the OpenAI envelope (never a 500 or a hang); models, health, request ids."""

from __future__ import annotations

import httpx
import openai
import pytest

pytestmark = pytest.mark.slow

HI = [{"role": "user", "content": "hi"}]


def _envelope(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


def test_unknown_model_is_404(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="no-such-model", messages=HI, max_tokens=1)
    assert "no-such-model" in info.value.message and info.value.body["param"] == "model"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="hi", max_tokens=1, stream=True)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", -1),
        ("top_p", 0),
        ("max_tokens", 0),
        ("n", 0),
        ("presence_penalty", 3),
        ("top_logprobs", 50),
    ],
)
def test_invalid_values_are_400_naming_the_field(
    client: openai.OpenAI, model_id: str, field: str, value
) -> None:
    extra = {"logprobs": True} if field == "top_logprobs" else {}
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=model_id, messages=HI, extra_body={field: value, **extra})
    assert info.value.status_code == 400
    assert info.value.body["param"] == field and field in info.value.message
    assert info.value.body["type"] == "invalid_request_error"


def test_invalid_requests_are_400(http: httpx.Client, model_id: str) -> None:
    cases = [
        ({"model": model_id}, "messages"),  # missing field
        ({"model": model_id, "messages": []}, "messages"),
        ({"model": model_id, "messages": [{"role": "wizard", "content": "x"}]}, "messages"),
        (
            {"model": model_id, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            "messages[0].content",
        ),
        ({"model": model_id, "messages": HI, "logit_bias": {"not-an-id": 1}}, "logit_bias"),
        ({"model": model_id, "messages": HI, "logit_bias": {"99999999": 1}}, "logit_bias"),
        ({"model": model_id, "messages": HI, "top_logprobs": 2}, "top_logprobs"),
        ({"model": model_id, "messages": HI, "max_tokens": 2, "min_tokens": 5}, "min_tokens"),
    ]
    for body, param in cases:
        assert _envelope(http.post("/v1/chat/completions", json=body), 400)["param"] == param, body
    for body, param in [
        ({"model": model_id, "prompt": []}, "prompt"),
        ({"model": model_id, "prompt": [99999999]}, "prompt"),
        ({"model": model_id, "prompt": "x", "logprobs": 99}, "logprobs"),
    ]:
        assert _envelope(http.post("/v1/completions", json=body), 400)["param"] == param, body


def test_malformed_bodies_are_400(http: httpx.Client) -> None:
    headers = {"content-type": "application/json"}
    for raw in (b'{"model": ', b"[1, 2]", b"", b'"text"'):
        _envelope(http.post("/v1/chat/completions", content=raw, headers=headers), 400)


def test_context_overflow_is_400_before_streaming(
    client: openai.OpenAI, http: httpx.Client, model_id: str
) -> None:
    max_len = http.get("/ready").json()["max_model_len"]
    long_prompt = "hello " * (max_len + 10)
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(
                model=model_id,
                messages=[{"role": "user", "content": long_prompt}],
                max_tokens=1,
                stream=stream,
            )
        assert info.value.body["param"] == "messages" and info.value.body["code"] == "context_length_exceeded"
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(model=model_id, prompt=long_prompt, max_tokens=1, stream=stream)
        assert info.value.body["param"] == "prompt"
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=model_id, messages=HI, max_tokens=max_len)
    assert info.value.body["param"] == "max_tokens" and str(max_len) in info.value.message


def test_unknown_route_and_wrong_method(http: httpx.Client) -> None:
    assert _envelope(http.get("/v1/nothing-here"), 404)["type"] == "not_found_error"
    _envelope(http.put("/v1/chat/completions"), 405)  # GET lists the stored chat completions (app/openai/stored.py)


def test_models_list_and_retrieve(client: openai.OpenAI, http: httpx.Client, model_id: str) -> None:
    body = http.get("/v1/models").json()
    assert body["object"] == "list"
    card = next(m for m in body["data"] if m["id"] == model_id)
    assert card["object"] == "model" and isinstance(card["created"], int) and card["owned_by"]
    assert card["custom_metadata"] == {
        "model_type": "llm",
        "provider_id": "peregrine",
        "provider_resource_id": model_id,
    }
    assert client.models.retrieve(model_id).id == model_id
    one = http.get(f"/v1/models/{model_id}").json()
    assert one["identifier"] == model_id and one["model_type"] == "llm"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")


def test_health_ready_and_request_id(http: httpx.Client) -> None:
    assert http.get("/health").status_code == 200
    ready = http.get("/ready")
    assert ready.status_code == 200 and ready.json()["status"] == "ready"
    assert http.get("/health/ready").status_code == 200
    r = http.get("/health", headers={"x-request-id": "abc-123"})
    assert r.headers["x-request-id"] == "abc-123"
    assert len(http.get("/health").headers["x-request-id"]) >= 16
    missing = http.get("/v1/nothing", headers={"x-request-id": "id-9"})
    assert missing.headers["x-request-id"] == "id-9"
    _envelope(missing, 404)
