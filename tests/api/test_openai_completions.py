"""POST /v1/completions through the real OpenAI SDK, against a real server and the bundled SmolLM2."""

from __future__ import annotations

import openai
import pytest

pytestmark = pytest.mark.slow

PROMPT = "The capital of France is"
PROMPT_IDS = [504, 3575, 282, 4649, 314]  # PROMPT in the bundled SmolLM2 tokenizer


def _stream(
    client: openai.OpenAI, model: str, **kwargs
) -> tuple[dict[int, str], dict[int, str | None], list]:
    chunks = list(client.completions.create(model=model, stream=True, **kwargs))
    texts: dict[int, str] = {}
    finish: dict[int, str | None] = {}
    for c in chunks:
        for choice in c.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
            finish[choice.index] = choice.finish_reason or finish.get(choice.index)
    return texts, finish, chunks


def test_non_stream_and_stream_agree(client: openai.OpenAI, model_id: str) -> None:
    r = client.completions.create(model=model_id, prompt=PROMPT, max_tokens=6, temperature=0)
    assert r.object == "text_completion" and r.id.startswith("cmpl-") and r.model == model_id
    choice = r.choices[0]
    assert choice.text and choice.finish_reason in ("stop", "length")
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    texts, finish, chunks = _stream(
        client, model_id, prompt=PROMPT, max_tokens=6, temperature=0, stream_options={"include_usage": True}
    )
    assert texts[0] == choice.text and finish[0] == choice.finish_reason
    usage = chunks[-1].usage  # the same prompt again: prompt_tokens_details.cached_tokens may differ
    assert chunks[-1].choices == [] and usage.model_dump(exclude={"prompt_tokens_details"}) == r.usage.model_dump(
        exclude={"prompt_tokens_details"})


def test_prompt_forms_and_n(client: openai.OpenAI, model_id: str) -> None:
    tok = client.completions.create(
        model=model_id, prompt=PROMPT, max_tokens=4, temperature=0, extra_body={"ignore_eos": True}
    )

    r = client.completions.create(
        model=model_id,
        prompt=[PROMPT, "Once upon a time"],
        max_tokens=4,
        temperature=0,
        n=2,
        extra_body={"ignore_eos": True},
    )
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert r.choices[0].text == r.choices[1].text == tok.choices[0].text
    assert r.choices[2].text == r.choices[3].text
    assert r.usage.completion_tokens == 16
    one = client.completions.create(model=model_id, prompt="Once upon a time", max_tokens=1)
    assert r.usage.prompt_tokens == tok.usage.prompt_tokens + one.usage.prompt_tokens

    texts, _, _ = _stream(
        client,
        model_id,
        prompt=[PROMPT, "Once upon a time"],
        max_tokens=4,
        temperature=0,
        n=2,
        extra_body={"ignore_eos": True},
    )
    assert [texts[i] for i in range(4)] == [c.text for c in r.choices]


def test_token_id_prompts(client: openai.OpenAI, model_id: str) -> None:
    by_text = client.completions.create(model=model_id, prompt=PROMPT, max_tokens=4, temperature=0, echo=True)
    assert by_text.usage.prompt_tokens == len(PROMPT_IDS)
    assert by_text.choices[0].text.startswith(PROMPT)
    continuation = by_text.choices[0].text[len(PROMPT) :]
    single = client.completions.create(model=model_id, prompt=PROMPT_IDS, max_tokens=4, temperature=0)
    batch = client.completions.create(
        model=model_id, prompt=[PROMPT_IDS, PROMPT_IDS], max_tokens=4, temperature=0
    )
    assert single.choices[0].text == continuation
    assert [c.text for c in batch.choices] == [continuation, continuation]
    assert batch.usage.prompt_tokens == 2 * len(PROMPT_IDS)


def test_stop_strings(client: openai.OpenAI, model_id: str) -> None:
    full = (
        client.completions.create(model=model_id, prompt=PROMPT, max_tokens=8, temperature=0).choices[0].text
    )
    word = full.split()[0]
    cut = client.completions.create(
        model=model_id, prompt=PROMPT, max_tokens=8, temperature=0, stop=[word, "zzz"]
    )
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == full[: full.index(word)]
    kept = client.completions.create(
        model=model_id,
        prompt=PROMPT,
        max_tokens=8,
        temperature=0,
        stop=word,
        extra_body={"include_stop_str_in_output": True},
    )
    assert kept.choices[0].text == full[: full.index(word) + len(word)]


def test_logprobs_shape(client: openai.OpenAI, model_id: str) -> None:
    r = client.completions.create(
        model=model_id,
        prompt=PROMPT,
        max_tokens=4,
        temperature=0,
        logprobs=3,
        extra_body={"ignore_eos": True},
    )
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 4
    assert "".join(lp.tokens) == r.choices[0].text
    assert lp.text_offset[0] == 0
    assert all(
        b - a == len(t) for a, b, t in zip(lp.text_offset, lp.text_offset[1:], lp.tokens, strict=False)
    )
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert logprob <= 0.0
        assert 3 <= len(top) <= 4 and top[token] == pytest.approx(logprob)
        assert max(top.values()) == pytest.approx(
            logprob, abs=1e-4
        )  # greedy: the chosen token is the top one
    as_bool = client.completions.create(
        model=model_id, prompt=PROMPT, max_tokens=2, temperature=0, extra_body={"logprobs": True}
    )
    assert len(as_bool.choices[0].logprobs.tokens) == as_bool.usage.completion_tokens
    streamed, _, chunks = _stream(
        client,
        model_id,
        prompt=PROMPT,
        max_tokens=4,
        temperature=0,
        logprobs=3,
        extra_body={"ignore_eos": True},
    )
    tokens = [t for c in chunks for ch in c.choices for t in (ch.logprobs.tokens if ch.logprobs else [])]
    assert tokens == lp.tokens
