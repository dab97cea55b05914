"""Prefix caching seen from a client: `usage.prompt_tokens_details.cached_tokens` (chat and completions, plain
and streamed) and the Prometheus counters, on a real server with the real OpenAI SDK."""

from __future__ import annotations

import uuid

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.slow
BLOCK = 16  # the default --block-size


def counters(http: httpx.Client) -> dict[str, float]:
    text = http.get("/metrics").text
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples
            if s.name.startswith("peregrine_prefix_cache_")}


def system_prompt() -> str:
    """Long and unique to this run, so nothing cached by earlier tests matches it."""
    tag = uuid.uuid4().hex
    return f"[{tag}] You are a terse assistant for a bird-watching club. " + "Answer in one short sentence. " * 12


def test_second_chat_turn_reports_cached_prompt_tokens(client: openai.OpenAI, model_id: str,
                                                       http: httpx.Client) -> None:
    before = counters(http)
    messages = [{"role": "system", "content": system_prompt()}, {"role": "user", "content": "Name a falcon."}]
    first = client.chat.completions.create(model=model_id, messages=messages, max_tokens=8, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "How fast does it fly?"}]
    stream = client.chat.completions.create(model=model_id, messages=messages, max_tokens=8, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    usage = [chunk.usage for chunk in stream if chunk.usage is not None][-1]
    cached = usage.prompt_tokens_details.cached_tokens
    assert first.usage.prompt_tokens // BLOCK * BLOCK <= cached < usage.prompt_tokens and cached % BLOCK == 0
    again = client.chat.completions.create(model=model_id, messages=messages, max_tokens=8, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens == (usage.prompt_tokens - 1) // BLOCK * BLOCK
    after = counters(http)
    hits = after["peregrine_prefix_cache_hits_total"] - before.get("peregrine_prefix_cache_hits_total", 0)
    queries = after["peregrine_prefix_cache_queries_total"] - before.get("peregrine_prefix_cache_queries_total", 0)
    assert hits >= cached + again.usage.prompt_tokens_details.cached_tokens
    assert queries >= first.usage.prompt_tokens + 2 * usage.prompt_tokens > hits


def test_completions_report_cached_tokens_plain_and_streamed(client: openai.OpenAI, model_id: str) -> None:
    prompt = system_prompt() + "\nQ: What do peregrines eat?\nA:"
    first = client.completions.create(model=model_id, prompt=prompt, max_tokens=4, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    expected = (first.usage.prompt_tokens - 1) // BLOCK * BLOCK
    second = client.completions.create(model=model_id, prompt=prompt, max_tokens=4, temperature=0)
    assert second.usage.prompt_tokens_details.cached_tokens == expected > 0
    assert second.choices[0].text == first.choices[0].text
    stream = client.completions.create(model=model_id, prompt=prompt, max_tokens=4, temperature=0, stream=True,
                                       stream_options={"include_usage": True})
    usage = [chunk.usage for chunk in stream if chunk.usage is not None][-1]
    assert usage.prompt_tokens_details.cached_tokens == expected
