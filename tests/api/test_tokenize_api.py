"""POST /tokenize and /detokenize (vLLM's shapes) against the real server, and their 4xx answers."""

from __future__ import annotations

import httpx
import pytest

pytestmark = pytest.mark.slow
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]


def test_tokenize_text_counts_what_completions_count(http: httpx.Client, model_id: str) -> None:
    text = "Peregrine falcons dive at over 300 km/h. Café 東京 🦅"
    r = http.post("/tokenize", json={"model": model_id, "prompt": text, "return_token_strs": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["count"] == len(body["tokens"]) == len(body["token_strs"]) > 5
    assert body["max_model_len"] == 2048  # the test server's --max-model-len
    usage = http.post("/v1/completions", json={"prompt": text, "max_tokens": 1}).json()["usage"]
    assert usage["prompt_tokens"] == body["count"]
    back = http.post("/detokenize", json={"model": model_id, "tokens": body["tokens"]})
    assert back.status_code == 200 and back.json() == {"prompt": text}
    assert http.post("/v1/completions",
                     json={"prompt": body["tokens"], "max_tokens": 1}).json()["usage"]["prompt_tokens"] == body["count"]


def test_tokenize_chat_counts_what_chat_completions_count(http: httpx.Client) -> None:
    templated = http.post("/tokenize", json={"messages": MESSAGES}).json()
    usage = http.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 1}).json()["usage"]
    assert templated["count"] == usage["prompt_tokens"]
    text = http.post("/detokenize", json={"tokens": templated["tokens"]}).json()["prompt"]
    assert "Name a colour." in text and text.count("Be brief.") == 1
    no_header = http.post("/tokenize", json={"messages": MESSAGES, "add_generation_prompt": False}).json()
    assert no_header["count"] < templated["count"]
    assert templated["tokens"][: no_header["count"]] == no_header["tokens"]
    last = [*MESSAGES, {"role": "assistant", "content": "Blue, and"}]
    cont = http.post("/tokenize", json={"messages": last, "add_generation_prompt": False,
                                        "continue_final_message": True}).json()
    assert http.post("/detokenize", json={"tokens": cont["tokens"]}).json()["prompt"].endswith("Blue, and")


@pytest.mark.parametrize(("path", "body", "status", "param"), [
    ("/tokenize", {}, 400, None),
    ("/tokenize", {"prompt": "a", "messages": MESSAGES}, 400, None),
    ("/tokenize", {"prompt": 5}, 400, "prompt"),
    ("/tokenize", {"messages": []}, 400, "messages"),
    ("/tokenize", {"messages": [{"role": "wizard", "content": "x"}]}, 400, None),
    ("/tokenize", {"messages": MESSAGES, "continue_final_message": True}, 400, "messages"),
    ("/tokenize", {"prompt": "a", "model": "no-such-model"}, 404, None),
    ("/detokenize", {"tokens": [1, -1]}, 400, "tokens"),
    ("/detokenize", {"tokens": [10**9]}, 400, "tokens"),
    ("/detokenize", {"tokens": "12"}, 400, "tokens"),
    ("/detokenize", {}, 400, "tokens"),
])
def test_bad_tokenizer_requests_get_the_error_envelope(http: httpx.Client, path: str, body: dict, status: int,
                                                       param: str | None) -> None:
    r = http.post(path, json=body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["message"] and error["type"]
    if param is not None:
        assert error["param"] == param


def test_the_tokenizer_routes_are_in_the_openapi_docs(http: httpx.Client) -> None:
    paths = http.get("/openapi.json").json()["paths"]
    for path in ("/tokenize", "/detokenize"):
        op = paths[path]["post"]
        assert "400" in op["responses"] and "vLLM" in op["description"]
    assert "add_generation_prompt" in paths["/tokenize"]["post"]["description"]
