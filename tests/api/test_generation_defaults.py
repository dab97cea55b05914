"""`--override-generation-config`: the server's default for sampling keys a request leaves out (vLLM's flag),
against a real server started with '{"temperature": 0}' (`greedy_server`) and the real OpenAI SDK."""

from __future__ import annotations

import openai
import pytest

MESSAGES = [{"role": "user", "content": "Write a short poem about the sea."}]


@pytest.fixture(scope="module")
def greedy(greedy_server: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{greedy_server}/v1", api_key="none", max_retries=0, timeout=300)


def _chat(client: openai.OpenAI, **sampling: object) -> str:
    out = client.chat.completions.create(model="smollm2", messages=MESSAGES, max_tokens=32, **sampling)
    return out.choices[0].message.content or ""


def test_a_request_without_temperature_is_greedy(greedy: openai.OpenAI) -> None:
    greedy_answer = _chat(greedy, temperature=0)
    assert greedy_answer
    # At OpenAI's default (1.0), two unseeded 32-token samples of the same prompt agreeing is all but impossible.
    assert _chat(greedy) == greedy_answer
    assert _chat(greedy) == greedy_answer
    streamed = greedy.responses.create(model="smollm2", input=MESSAGES[0]["content"], max_output_tokens=32)
    again = greedy.responses.create(model="smollm2", input=MESSAGES[0]["content"], max_output_tokens=32)
    assert streamed.output_text and streamed.output_text == again.output_text
    assert streamed.temperature == 0  # the response shows the temperature used, the server's default


def test_the_request_s_own_temperature_wins(greedy: openai.OpenAI) -> None:
    sampled = {_chat(greedy, temperature=1.5, seed=seed) for seed in (1, 2, 3)}
    assert len(sampled) > 1, "explicit temperature 1.5 with different seeds gave one answer: the default overrode it"
