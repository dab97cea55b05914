"""Prompt logprobs over HTTP: echo + logprobs, max_tokens 0, vLLM's prompt_logprobs (completions and chat),
streamed and not, and the 400s for what cannot be served."""

from __future__ import annotations

import json

import httpx
import pytest

pytestmark = pytest.mark.slow
PROMPT = "The capital of France is Paris. The capital of Italy is"


def complete(http: httpx.Client, **body: object) -> dict:
    r = http.post("/v1/completions", json={"prompt": PROMPT, "temperature": 0, **body})
    assert r.status_code == 200, r.text
    return r.json()


def test_echo_logprobs_cover_the_prompt_then_the_generated_tokens(http: httpx.Client, model_id: str) -> None:
    ids = http.post("/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    scored = complete(http, model=model_id, echo=True, logprobs=2, max_tokens=0)
    (choice,) = scored["choices"]
    lp = choice["logprobs"]
    assert choice["text"] == PROMPT and choice["finish_reason"] == "length"
    assert scored["usage"]["completion_tokens"] == 0 and scored["usage"]["prompt_tokens"] == len(ids)
    assert len(lp["token_logprobs"]) == len(ids) and lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert all(isinstance(x, float) and x <= 0 for x in lp["token_logprobs"][1:])
    assert "".join(lp["tokens"]) == PROMPT and lp["text_offset"][0] == 0
    for token, value, top in zip(lp["tokens"][1:], lp["token_logprobs"][1:], lp["top_logprobs"][1:], strict=True):
        assert top[token] == value and len(top) in (2, 3)  # the token itself plus the 2 most likely
    one = complete(http, model=model_id, echo=True, logprobs=2, max_tokens=1)["choices"][0]["logprobs"]
    assert one["token_logprobs"][: len(ids)] == pytest.approx(lp["token_logprobs"], abs=1e-5)
    assert len(one["token_logprobs"]) == len(ids) + 1 and one["text_offset"][-1] == len(PROMPT)


def test_vllm_prompt_logprobs_and_streams(http: httpx.Client) -> None:
    body = {"prompt": PROMPT, "temperature": 0, "max_tokens": 3, "prompt_logprobs": 1, "echo": True, "logprobs": 0}
    whole = http.post("/v1/completions", json=body).json()["choices"][0]
    entries = whole["prompt_logprobs"]
    assert entries[0] is None and len(entries) == len(whole["logprobs"]["tokens"]) - 3
    for entry, value in zip(entries[1:], whole["logprobs"]["token_logprobs"][1:], strict=False):
        ranks = sorted(v["rank"] for v in entry.values())
        assert ranks[0] >= 1 and value in [pytest.approx(v["logprob"], abs=1e-5) for v in entry.values()]
    with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    first = chunks[0]["choices"][0]
    assert first["prompt_logprobs"] == entries and first["text"].startswith(PROMPT)
    streamed = [t for c in chunks for t in c["choices"][0]["logprobs"]["token_logprobs"]]
    assert streamed == pytest.approx(whole["logprobs"]["token_logprobs"], abs=1e-5)
    chat = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2,
                                                   "prompt_logprobs": 0}).json()
    assert chat["prompt_logprobs"][0] is None and len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"]


@pytest.mark.parametrize(("body", "param"), [
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": -1, "echo": True}, "max_tokens"),
    ({"prompt_logprobs": 21}, "prompt_logprobs"),
    ({"prompt_logprobs": -1}, "prompt_logprobs"),
    ({"prompt_logprobs": "all"}, "prompt_logprobs"),
    ({"echo": True, "logprobs": 21}, "logprobs"),
])
def test_bad_scoring_requests_are_400s(http: httpx.Client, body: dict, param: str) -> None:
    r = http.post("/v1/completions", json={"prompt": PROMPT, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
