"""Exercise a server with the real llama-stack-client 0.2.x native inference API; print what it saw as JSON.

Runs inside that client's own virtual environment (Python 3.11, with `fire` and `requests` beside it),
started by tests/api/test_llama_stack_clients.py, which makes the assertions.
Usage: python lsc_legacy.py BASE_URL LLM_ID EMBEDDING_ID
"""

from __future__ import annotations

import json
import sys

from llama_stack_client import LlamaStackClient

GREEDY = {"strategy": {"type": "greedy"}, "max_tokens": 8}


def chat(client: LlamaStackClient, llm: str) -> dict:
    messages = [{"role": "user", "content": [{"type": "text", "text": "Name a colour."}]}]
    reply = client.inference.chat_completion(
        model_id=llm, messages=messages, sampling_params=GREEDY, logprobs={"top_k": 2}
    )
    events = [c.event for c in client.inference.chat_completion(
        model_id=llm, messages=messages, sampling_params=GREEDY, stream=True)]  # fmt: skip
    sampled = client.inference.chat_completion(
        model_id=llm,
        messages=messages,
        sampling_params={"strategy": {"type": "top_p", "temperature": 0.7, "top_p": 0.9}, "max_tokens": 4},
    )
    tool_turns = [
        {"role": "user", "content": "What is the weather in Oslo?"},
        {"role": "assistant", "content": "", "stop_reason": "end_of_message",
         "tool_calls": [{"call_id": "c1", "tool_name": "get_weather", "arguments": {"city": "Oslo"}}]},
        {"role": "tool", "call_id": "c1", "content": "Rain, 8 degrees."},
    ]  # fmt: skip
    after_tool = client.inference.chat_completion(model_id=llm, messages=tool_turns, sampling_params=GREEDY)
    return {
        "chat": {
            "content": reply.completion_message.content,
            "role": reply.completion_message.role,
            "stop_reason": reply.completion_message.stop_reason,
            "logprobs": [lp.logprobs_by_token for lp in reply.logprobs or []],
            "metrics": {m.metric: m.value for m in reply.metrics or []},
        },
        "chat_stream": {
            "event_types": [e.event_type for e in events],
            "text": "".join(e.delta.text for e in events if e.delta.type == "text"),
            "delta_types": sorted({e.delta.type for e in events}),
            "stop_reasons": [e.stop_reason for e in events if e.stop_reason],
        },
        "chat_sampled_stop_reason": sampled.completion_message.stop_reason,
        "chat_after_tool": after_tool.completion_message.content,
    }


def completion(client: LlamaStackClient, llm: str) -> dict:
    prompt = "The capital of France is"
    reply = client.inference.completion(model_id=llm, content=prompt, sampling_params=GREEDY)
    chunks = list(
        client.inference.completion(model_id=llm, content=prompt, sampling_params=GREEDY, stream=True)
    )
    return {
        "completion": {"content": reply.content, "stop_reason": reply.stop_reason},
        "completion_stream": {
            "text": "".join(c.delta for c in chunks),
            "stop_reasons": [c.stop_reason for c in chunks if c.stop_reason],
        },
    }


def embeddings(client: LlamaStackClient, emb: str) -> dict:
    reply = client.inference.embeddings(
        model_id=emb, contents=["Falcons are fast.", "Peregrines dive at 300 km/h."]
    )
    short = client.inference.embeddings(model_id=emb, contents=["Falcons are fast."], output_dimension=32)
    return {"embeddings": reply.embeddings, "embeddings_32": short.embeddings}


def main(base_url: str, llm: str, emb: str) -> None:
    client = LlamaStackClient(base_url=base_url, max_retries=0, timeout=300)
    out: dict = {"client_version": __import__("llama_stack_client").__version__}
    out["models"] = {m.identifier: m.api_model_type for m in client.models.list()}
    out |= chat(client, llm)
    out |= completion(client, llm)
    out |= embeddings(client, emb)
    print(json.dumps(out))


if __name__ == "__main__":
    main(*sys.argv[1:])
