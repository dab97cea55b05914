"""POST /v1/chat/completions through the real OpenAI SDK, against a real server and the bundled SmolLM2."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

pytestmark = pytest.mark.slow

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
MAX_TOKENS = 12


def _stream_text(client: openai.OpenAI, model: str, **kwargs) -> tuple[str, str | None, list]:
    stream = client.chat.completions.create(model=model, stream=True, **kwargs)
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = next((c.choices[0].finish_reason for c in reversed(chunks) if c.choices), None)
    return text, finish, chunks


@pytest.fixture(scope="module")
def paris(client: openai.OpenAI, model_id: str):
    """The greedy non-stream answer to the question, shared by the tests that compare against it."""
    return client.chat.completions.create(
        model=model_id, messages=QUESTION, max_tokens=MAX_TOKENS, temperature=0
    )


def test_capital_of_france_non_stream(paris, model_id: str) -> None:
    assert "Paris" in paris.choices[0].message.content
    assert paris.choices[0].message.role == "assistant"
    assert paris.choices[0].finish_reason in ("stop", "length")
    assert paris.choices[0].logprobs is None
    assert paris.object == "chat.completion" and paris.id.startswith("chatcmpl-") and paris.model == model_id
    usage = paris.usage
    assert usage.prompt_tokens > 0 and 0 < usage.completion_tokens <= MAX_TOKENS
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


def test_capital_of_france_stream_equals_non_stream(client: openai.OpenAI, model_id: str, paris) -> None:
    text, finish, chunks = _stream_text(
        client,
        model_id,
        messages=QUESTION,
        max_tokens=MAX_TOKENS,
        temperature=0,
        stream_options={"include_usage": True},
    )
    assert text == paris.choices[0].message.content
    assert finish == paris.choices[0].finish_reason
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    last = chunks[-1]  # stream_options.include_usage: a last chunk with no choices carries the usage
    assert last.choices == [] and _counts(last.usage) == _counts(paris.usage)
    # the same prompt again: its full blocks come from the prefix cache
    assert last.usage.prompt_tokens_details.cached_tokens == (paris.usage.prompt_tokens - 1) // 16 * 16
    assert all(c.usage is None for c in chunks[:-1])


def test_stream_selected_by_body_not_accept_header(http: httpx.Client, model_id: str) -> None:
    body = {"model": model_id, "messages": QUESTION, "max_tokens": 3, "stream": True}
    r = http.post("/v1/chat/completions", json=body, headers={"Accept": "application/json"})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = [line.removeprefix("data: ") for line in r.text.split("\n\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert all(json.loads(e)["object"] == "chat.completion.chunk" for e in events[:-1])


def test_length_and_usage_counts(client: openai.OpenAI, model_id: str) -> None:
    r = client.chat.completions.create(
        model=model_id, messages=QUESTION, max_tokens=3, temperature=0, extra_body={"ignore_eos": True}
    )
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 3
    r2 = client.chat.completions.create(
        model=model_id,
        messages=QUESTION,
        max_completion_tokens=2,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert r2.usage.completion_tokens == 2 and r2.usage.prompt_tokens == r.usage.prompt_tokens


def test_n_choices(client: openai.OpenAI, model_id: str) -> None:
    kwargs = dict(
        model=model_id, messages=QUESTION, max_tokens=4, n=2, temperature=0, extra_body={"ignore_eos": True}
    )
    r = client.chat.completions.create(**kwargs)
    assert [c.index for c in r.choices] == [0, 1]
    assert r.choices[0].message.content == r.choices[1].message.content  # greedy: identical
    assert r.usage.completion_tokens == 8  # counted over both choices

    _, _, chunks = _stream_text(client, **kwargs)
    texts = {0: "", 1: ""}
    for c in chunks:
        for choice in c.choices:
            texts[choice.index] += choice.delta.content or ""
    assert texts[0] == texts[1] == r.choices[0].message.content


def test_stop_string(client: openai.OpenAI, model_id: str) -> None:
    full = client.chat.completions.create(
        model=model_id, messages=QUESTION, max_tokens=MAX_TOKENS, temperature=0
    )
    text = full.choices[0].message.content
    assert "Paris" in text
    r = client.chat.completions.create(
        model=model_id, messages=QUESTION, max_tokens=MAX_TOKENS, temperature=0, stop=["Paris"]
    )
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].message.content == text[: text.index("Paris")]
    streamed, finish, _ = _stream_text(
        client, model_id, messages=QUESTION, max_tokens=MAX_TOKENS, temperature=0, stop="Paris"
    )
    assert streamed == r.choices[0].message.content and finish == "stop"


def test_logprobs_shape(client: openai.OpenAI, model_id: str) -> None:
    r = client.chat.completions.create(
        model=model_id, messages=QUESTION, max_tokens=4, temperature=0, logprobs=True, top_logprobs=2
    )
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    assert "".join(t.token for t in content) == r.choices[0].message.content
    for t in content:
        assert t.logprob <= 0.0 and t.bytes == list(t.token.encode())
        assert len(t.top_logprobs) == 2
        assert t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob
        assert t.logprob == pytest.approx(t.top_logprobs[0].logprob, abs=1e-4)  # greedy picks the top one


def test_content_parts_and_system_message(client: openai.OpenAI, model_id: str, paris) -> None:
    text_parts = [{"type": "text", "text": "What is the capital "}, {"type": "text", "text": "of France?"}]
    parts = [{"role": "user", "content": text_parts}]
    a = client.chat.completions.create(model=model_id, messages=parts, max_tokens=1, temperature=0)
    assert a.usage.prompt_tokens == paris.usage.prompt_tokens
    assert paris.choices[0].message.content.startswith(a.choices[0].message.content)
    sys_msgs = [{"role": "system", "content": "Answer in one word."}, *QUESTION]
    c = client.chat.completions.create(model=model_id, messages=sys_msgs, max_tokens=1, temperature=0)
    assert c.usage.prompt_tokens != paris.usage.prompt_tokens


def test_seeded_sampling_is_reproducible(client: openai.OpenAI, model_id: str) -> None:
    kwargs = dict(model=model_id, messages=QUESTION, max_tokens=4, temperature=1.0, seed=1234, top_p=0.9)
    a = client.chat.completions.create(**kwargs)
    b = client.chat.completions.create(**kwargs)
    assert a.choices[0].message.content == b.choices[0].message.content


def test_vllm_extra_sampling_keys_accepted(client: openai.OpenAI, model_id: str) -> None:
    r = client.chat.completions.create(
        model=model_id,
        messages=QUESTION,
        max_tokens=3,
        temperature=0.7,
        presence_penalty=0.5,
        frequency_penalty=0.5,
        logit_bias={"0": -100},
        user="tester",
        extra_body={
            "top_k": 20,
            "min_p": 0.05,
            "repetition_penalty": 1.1,
            "min_tokens": 2,
            "stop_token_ids": [0],
            "skip_special_tokens": True,
            "include_stop_str_in_output": False,
        },
    )
    assert r.usage.completion_tokens >= 2


def _counts(usage) -> dict:
    """The token counts of a usage object, without the cache details (they depend on what ran before)."""
    return usage.model_dump(exclude={"prompt_tokens_details"})
