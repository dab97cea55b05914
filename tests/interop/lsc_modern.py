"""Exercise a server with the real llama-stack-client 0.7.x; print what the client saw as one JSON object.

Runs inside that client's own virtual environment (Python 3.12), started by
tests/api/test_llama_stack_clients.py and tests/api/test_llama_stack_server.py, which make the assertions.
Usage: python lsc_modern.py BASE_URL LLM_ID EMBEDDING_ID
"""

from __future__ import annotations

import base64
import json
import struct
import sys

from llama_stack_client import LlamaStackClient

PROMPT = [{"role": "user", "content": "Name a colour."}]


def chat(client: LlamaStackClient, llm: str) -> dict:
    reply = client.chat.completions.create(model=llm, messages=PROMPT, max_tokens=8, temperature=0)
    chunks = list(
        client.chat.completions.create(model=llm, messages=PROMPT, max_tokens=8, temperature=0, stream=True)
    )
    # vLLM's extra sampling keys, the way Llama Stack's own providers send them
    extra = client.chat.completions.create(
        model=llm,
        messages=PROMPT,
        max_tokens=8,
        temperature=1.5,
        extra_body={"top_k": 1, "repetition_penalty": 1.0},
    )
    return {
        "chat": {
            "content": reply.choices[0].message.content,
            "finish_reason": reply.choices[0].finish_reason,
            "completion_tokens": reply.usage.completion_tokens if reply.usage else None,
        },
        "chat_stream": {
            "deltas": [
                c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content
            ],
            "finish_reasons": [
                c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
            ],
            "objects": sorted({c.object for c in chunks}),
        },
        "chat_top_k_1": extra.choices[0].message.content,
    }


def forced_done(client: LlamaStackClient, llm: str) -> dict:
    """Stream with `[DONE]` forced on (X-Peregrine-Done): what the client does with it (None: fine)."""
    try:
        stream = client.chat.completions.create(
            model=llm,
            messages=PROMPT,
            max_tokens=4,
            temperature=0,
            stream=True,
            extra_headers={"X-Peregrine-Done": "true"},
        )
        deltas = [c.choices[0].delta.content for c in stream if c.choices]
    except Exception as exc:  # noqa: BLE001 - the point is to report which error the client raises
        return {"forced_done_error": type(exc).__name__}
    return {"forced_done_error": None, "forced_done_deltas": len(deltas)}


def completions(client: LlamaStackClient, llm: str) -> dict:
    prompt = "The capital of France is"
    reply = client.completions.create(model=llm, prompt=prompt, max_tokens=6, temperature=0)
    chunks = list(
        client.completions.create(model=llm, prompt=prompt, max_tokens=6, temperature=0, stream=True)
    )
    return {
        "completion": {"text": reply.choices[0].text, "finish_reason": reply.choices[0].finish_reason},
        "completion_stream": {
            "text": "".join(c.choices[0].text for c in chunks if c.choices),
            "finish_reasons": [
                c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
            ],
        },
    }


def embeddings(client: LlamaStackClient, emb: str) -> dict:
    texts = ["Falcons are fast.", "Peregrines dive at 300 km/h."]
    floats = client.embeddings.create(model=emb, input=texts)
    packed = client.embeddings.create(model=emb, input=texts[0], encoding_format="base64", dimensions=64)
    raw = base64.b64decode(packed.data[0].embedding)
    return {
        "embeddings": [d.embedding for d in sorted(floats.data, key=lambda d: d.index)],
        "embeddings_model": floats.model,
        "embeddings_prompt_tokens": floats.usage.prompt_tokens,
        "embedding_b64_64": list(struct.unpack(f"<{len(raw) // 4}f", raw)),
    }


def models(client: LlamaStackClient, llm: str, emb: str) -> dict:
    listed = client.models.list()
    got = {m.id: {"model_type": m.model_type, "provider_id": m.provider_id,
                  "provider_resource_id": m.provider_resource_id, "metadata": m.metadata} for m in listed}  # fmt: skip
    out = {"models": got}
    for key, model_id in (("retrieve_llm", llm), ("retrieve_embedding", emb)):
        one = client.models.retrieve(model_id)
        out[key] = {"identifier": one.identifier, "model_type": one.api_model_type, "provider_id": one.provider_id,
                    "provider_resource_id": one.provider_resource_id}  # fmt: skip
    return out


def main(
    base_url: str, llm: str, emb: str, parts: str = "inspect,models,chat,completions,embeddings"
) -> None:
    client = LlamaStackClient(base_url=base_url, max_retries=0, timeout=300)
    out: dict = {"client_version": __import__("llama_stack_client").__version__}
    wanted = set(parts.split(","))
    if "inspect" in wanted:
        out["health"] = client.inspect.health().status
        out["version"] = client.inspect.version().version
    if "models" in wanted:
        out |= models(client, llm, emb)
    if "chat" in wanted:
        out |= chat(client, llm)
    if "completions" in wanted:
        out |= completions(client, llm)
    if "embeddings" in wanted:
        out |= embeddings(client, emb)
    if "forced_done" in wanted:
        out |= forced_done(client, llm)
    print(json.dumps(out))


if __name__ == "__main__":
    main(*sys.argv[1:])
