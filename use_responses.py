"""use.py's Responses API checks (`/v1/responses`, stream and not, a stored conversation) and the stored chat
completions, through the real `openai` SDK."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import openai

from use_llama_stack import QUESTION, expect


def check_responses(ctx: Any) -> str:
    client: openai.OpenAI = ctx.client
    first = client.responses.create(model=ctx.model, input=QUESTION, max_output_tokens=ctx.max_tokens,
                                    temperature=0)
    expect(bool(first.output_text.strip()), "empty response")
    second = client.responses.create(model=ctx.model, input="And of Italy?", previous_response_id=first.id,
                                     max_output_tokens=ctx.max_tokens, temperature=0)
    expect(second.usage.input_tokens > first.usage.input_tokens, "previous_response_id did not carry the history")
    expect(client.responses.retrieve(second.id).id == second.id, "the stored response was not found")
    for response in (second, first):
        client.responses.delete(response.id)
    return f"{first.output_text!r} then {second.output_text!r} (usage={second.usage.model_dump()})"


def check_responses_stream(ctx: Any) -> str:
    client: openai.OpenAI = ctx.client
    with client.responses.stream(model=ctx.model, input=QUESTION, max_output_tokens=ctx.max_tokens,
                                 temperature=0, store=False) as stream:
        events = list(stream)
    types, final = [event.type for event in events], events[-1].response  # completed or incomplete
    expect(types[0] == "response.created" and types[-1] in ("response.completed", "response.incomplete"),
           f"events {types[:2]} ... {types[-2:]}")
    return f"{final.output_text!r} ({len(types)} events, {final.status})"


def check_stored_chat_completion(ctx: Any) -> str:
    client: openai.OpenAI = ctx.client
    made = client.chat.completions.create(model=ctx.model, messages=[{"role": "user", "content": QUESTION}],
                                          max_tokens=ctx.max_tokens, temperature=0, store=True,
                                          metadata={"from": "use.py"})
    got = client.chat.completions.retrieve(made.id)
    expect(got.choices[0].message.content == made.choices[0].message.content, "stored content differs")
    client.chat.completions.delete(made.id)
    return f"{made.id} stored, read back and deleted"


RESPONSES_CHECKS: list[tuple[str, Callable[[Any], str]]] = [
    ("responses (previous_response_id, retrieve, delete)", check_responses),
    ("responses stream", check_responses_stream),
    ("chat completions store", check_stored_chat_completion),
]
