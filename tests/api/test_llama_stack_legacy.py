"""The legacy Llama Stack inference API against a real server, with raw requests in each client era's shapes.

0.0.x: `/inference/chat_completion`, `model`, `strategy` as a bare string with its numbers beside it,
role `ipython`, bare-string stream deltas. 0.0.53+: `/alpha/inference/*`, `model_id`. 0.1.x/0.2.x:
`/v1/inference/*`, tagged-union strategy, role `tool`. (The real 0.2.x client is driven in
test_llama_stack_clients.py.) Greedy answers must agree across eras and with the OpenAI route.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

pytestmark = pytest.mark.slow
USER = [{"role": "user", "content": "Name three birds."}]
MAX = 8


def post(http: httpx.Client, path: str, body: dict[str, Any], status: int = 200) -> dict[str, Any]:
    response = http.post(path, json=body)
    assert response.status_code == status, response.text
    return response.json()


def sse(http: httpx.Client, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    response = http.post(path, json=body | {"stream": True})
    assert response.status_code == 200, response.text
    return [
        json.loads(line.removeprefix("data: "))
        for line in response.text.split("\n\n")
        if line.startswith("data: ")
    ]


@pytest.fixture(scope="module")
def greedy_chat(http: httpx.Client, model_id: str) -> str:
    """The OpenAI route's greedy answer: every legacy shape below must give the same text."""
    body = {"model": model_id, "messages": USER, "max_tokens": MAX, "temperature": 0}
    return post(http, "/v1/chat/completions", body)["choices"][0]["message"]["content"]


@pytest.mark.parametrize(
    ("path", "model_key", "sampling"),
    [
        ("/inference/chat_completion", "model", {"strategy": "greedy", "temperature": 0.9, "top_p": 0.5}),
        ("/inference/chat_completion", "model_id", {"strategy": "top_k", "top_k": 1, "temperature": 1.0}),
        ("/alpha/inference/chat-completion", "model_id", {"strategy": "greedy"}),
        ("/v1/inference/chat-completion", "model_id", {"strategy": {"type": "greedy"}}),
        ("/v1/inference/chat-completion", "model_id", {"strategy": {"type": "top_k", "top_k": 1}}),
    ],
)
def test_chat_in_every_era_shape(http, model_id, greedy_chat, path, model_key, sampling) -> None:
    body = {model_key: model_id, "messages": USER, "sampling_params": sampling | {"max_tokens": MAX}}
    reply = post(http, path, body)
    message = reply["completion_message"]
    assert message == {
        "role": "assistant",
        "content": greedy_chat,
        "stop_reason": "out_of_tokens",
        "tool_calls": [],
    }
    assert reply["logprobs"] is None
    assert {m["metric"]: m["value"] for m in reply["metrics"]}["completion_tokens"] == MAX


def test_chat_without_a_model_uses_the_served_one(http, greedy_chat) -> None:
    body = {"messages": USER, "sampling_params": {"max_tokens": MAX}}
    assert post(http, "/v1/inference/chat-completion", body)["completion_message"]["content"] == greedy_chat


def test_content_as_string_item_or_list(http, model_id) -> None:
    def answer(content: Any) -> str:
        body = {"model_id": model_id, "messages": [{"role": "user", "content": content}],
                "sampling_params": {"max_tokens": MAX}}  # fmt: skip
        return post(http, "/v1/inference/chat-completion", body)["completion_message"]["content"]

    plain = answer("Name three birds.")
    assert answer({"type": "text", "text": "Name three birds."}) == plain
    assert answer([{"type": "text", "text": "Name three"}, "birds."]) == plain
    image = {"type": "image", "image": {"url": {"uri": "https://example.invalid/a.png"}}}
    error = post(http, "/v1/inference/chat-completion",
                 {"model_id": model_id, "messages": [{"role": "user", "content": [image]}]}, 400)  # fmt: skip
    assert "text" in error["error"]["message"] and error["error"]["param"].startswith("messages[0]")


def test_tool_results_as_tool_or_ipython(http, model_id) -> None:
    call = {"call_id": "c1", "tool_name": "get_weather", "arguments": {"city": "Oslo"}}
    turns = [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": "", "stop_reason": "end_of_message", "tool_calls": [call]},
    ]
    answers = []
    for role in ("tool", "ipython"):
        result = {"role": role, "call_id": "c1", "tool_name": "get_weather", "content": "Rain, 8 degrees."}
        body = {"model_id": model_id, "messages": [*turns, result], "sampling_params": {"max_tokens": MAX}}
        answers.append(post(http, "/v1/inference/chat-completion", body)["completion_message"]["content"])
    assert answers[0] == answers[1] and answers[0]


def test_chat_stream_both_delta_styles(http, model_id, greedy_chat) -> None:
    body = {"model_id": model_id, "messages": USER, "sampling_params": {"max_tokens": MAX}}
    typed = [e["event"] for e in sse(http, "/v1/inference/chat-completion", body)]
    bare = [e["event"] for e in sse(http, "/inference/chat_completion", body)]
    for events, text_of in ((typed, lambda d: d["text"]), (bare, lambda d: d)):
        assert events[0]["event_type"] == "start" and events[-1]["event_type"] == "complete"
        assert {e["event_type"] for e in events[1:-1]} == {"progress"}
        assert "".join(text_of(e["delta"]) for e in events) == greedy_chat
        assert [e["stop_reason"] for e in events] == [None] * (len(events) - 1) + ["out_of_tokens"]


def test_stop_string_ends_the_turn(http, model_id, greedy_chat) -> None:
    stop = greedy_chat[len(greedy_chat) // 2 :][:2]
    body = {"model_id": model_id, "messages": USER, "sampling_params": {"max_tokens": MAX, "stop": [stop]}}
    message = post(http, "/v1/inference/chat-completion", body)["completion_message"]
    assert message["stop_reason"] == "end_of_turn"
    assert message["content"] == greedy_chat[: greedy_chat.index(stop)]


def test_logprobs_by_token(http, model_id) -> None:
    body = {
        "model_id": model_id,
        "messages": USER,
        "sampling_params": {"max_tokens": 4},
        "logprobs": {"top_k": 2},
    }
    reply = post(http, "/v1/inference/chat-completion", body)
    assert len(reply["logprobs"]) == 4
    for entry in reply["logprobs"]:
        assert 1 <= len(entry["logprobs_by_token"]) <= 3  # the chosen token and up to two alternatives
        assert all(v <= 0.0 for v in entry["logprobs_by_token"].values())
    events = sse(http, "/v1/inference/chat-completion", body)
    streamed = [lp for e in events if e["event"]["logprobs"] for lp in e["event"]["logprobs"]]
    assert streamed == reply["logprobs"]


@pytest.mark.parametrize(
    ("path", "model_key", "sampling"),
    [
        ("/inference/completion", "model", {"strategy": "greedy"}),
        ("/alpha/inference/completion", "model_id", {"strategy": "top_k", "top_k": 1}),
        ("/v1/inference/completion", "model_id", {"strategy": {"type": "greedy"}}),
    ],
)
def test_completion_in_every_era_shape(http, model_id, path, model_key, sampling) -> None:
    prompt = "The capital of France is"
    expected = post(
        http, "/v1/completions", {"model": model_id, "prompt": prompt, "max_tokens": MAX, "temperature": 0}
    )
    body = {model_key: model_id, "content": prompt, "sampling_params": sampling | {"max_tokens": MAX}}
    reply = post(http, path, body)
    assert reply["content"] == expected["choices"][0]["text"]
    assert reply["stop_reason"] == "out_of_tokens"
    chunks = sse(http, path, body)
    assert "".join(c["delta"] for c in chunks) == reply["content"]
    assert [c["stop_reason"] for c in chunks][-1] == "out_of_tokens"


def test_batches_equal_single_requests(http, model_id, greedy_chat) -> None:
    other = [{"role": "user", "content": "Say hello."}]
    body = {"model_id": model_id, "messages_batch": [USER, other], "sampling_params": {"max_tokens": MAX}}
    batch = post(http, "/v1/inference/batch-chat-completion", body)["batch"]
    single = post(http, "/v1/inference/chat-completion",
                  {"model_id": model_id, "messages": other, "sampling_params": {"max_tokens": MAX}})  # fmt: skip
    assert [b["completion_message"]["content"] for b in batch] == [
        greedy_chat,
        single["completion_message"]["content"],
    ]
    prompts = ["One, two,", "Red, green,"]
    body = {"model_id": model_id, "content_batch": prompts, "sampling_params": {"max_tokens": 4}}
    batch = post(http, "/v1/inference/batch-completion", body)["batch"]
    for prompt, item in zip(prompts, batch, strict=True):
        alone = post(http, "/v1/inference/completion",
                     {"model_id": model_id, "content": prompt, "sampling_params": {"max_tokens": 4}})  # fmt: skip
        assert item["content"] == alone["content"]


def test_errors_use_the_envelope(http, model_id) -> None:
    err = post(http, "/v1/inference/chat-completion", {"model_id": "nope", "messages": USER}, 404)["error"]
    assert err["code"] == "model_not_found"
    body = {
        "model_id": model_id,
        "messages": USER,
        "response_format": {"type": "regex", "regex": "a+"},  # Llama Stack knows json_schema and grammar only
    }
    assert post(http, "/v1/inference/chat-completion", body, 400)["error"]["param"] == "response_format.type"
    body = {
        "model_id": model_id,
        "messages": USER,
        "sampling_params": {"strategy": {"type": "top_p", "top_p": 2}},
    }
    assert post(http, "/v1/inference/chat-completion", body, 400)["error"]["type"] == "invalid_request_error"
    huge = {"model_id": model_id, "content": "x", "sampling_params": {"max_tokens": 10**7}}
    assert post(http, "/v1/inference/completion", huge, 400)["error"]["code"] == "context_length_exceeded"


def test_legacy_embeddings_match_openai_route(http) -> None:
    texts = ["Falcons are fast.", "Peregrines dive."]
    openai_shape = post(http, "/v1/embeddings", {"input": texts})
    expected = [d["embedding"] for d in openai_shape["data"]]
    name = openai_shape["model"]
    for path, key in (("/inference/embeddings", "model"), ("/alpha/inference/embeddings", "model_id"),
                      ("/v1/inference/embeddings", "model_id")):  # fmt: skip
        got = post(http, path, {key: name, "contents": texts})["embeddings"]
        assert len(got) == 2 and all(
            abs(a - b) < 1e-5 for g, e in zip(got, expected, strict=True) for a, b in zip(g, e, strict=True)
        )
    items = post(http, "/v1/inference/embeddings", {"model_id": name, "contents": [{"type": "text", "text": texts[0]}],
                                                    "output_dimension": 16})["embeddings"]  # fmt: skip
    assert len(items[0]) == 16
    long_text = "word " * 400
    err = post(
        http,
        "/v1/inference/embeddings",
        {"model_id": name, "contents": [long_text], "text_truncation": "none"},
        400,
    )
    assert err["error"]["code"] == "context_length_exceeded"
    assert (
        len(
            post(http, "/v1/inference/embeddings", {"model_id": name, "contents": [long_text]})["embeddings"][
                0
            ]
        )
        == 384
    )
