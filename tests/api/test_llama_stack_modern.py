"""The modern Llama Stack surface and /v1/embeddings against a real server, with the real openai SDK.

Inspect and provider routes, the models list with `custom_metadata`, `GET /v1/models/{id}` in the
union shape, embeddings (float, base64, dimensions) equal to sentence-transformers' own vectors, and the
vLLM-style sampling keys sent at top level through `extra_body`.
"""

from __future__ import annotations

import math

import httpx
import openai
import pytest

from tests.interop.harness import cosine, embedding_id

__all__ = ["embedding_id"]  # a fixture, imported so pytest finds it here

pytestmark = pytest.mark.slow
TEXTS = ["The peregrine falcon is the fastest bird.", "Embeddings map text to vectors.", "hi"]


def test_inspect_and_providers(http: httpx.Client) -> None:
    assert http.get("/v1/health").json() == {"status": "OK"}
    assert http.get("/v1/version").json()["version"]
    providers = http.get("/v1/providers").json()["data"]
    assert providers == [{"api": "inference", "provider_id": "peregrine", "provider_type": "remote::peregrine",
                          "config": {}, "health": {"status": "OK"}}]  # fmt: skip
    assert http.get("/v1/providers/peregrine").json()["provider_id"] == "peregrine"
    assert http.get("/v1/providers/other").status_code == 404
    routes = {(r["route"], r["method"]) for r in http.get("/v1/inspect/routes").json()["data"]}
    assert {("/v1/chat/completions", "POST"), ("/v1/embeddings", "POST"), ("/v1/health", "GET")} <= routes


def test_models_carry_llama_stack_metadata(http: httpx.Client, model_id: str, embedding_id: str) -> None:
    listed = {m["id"]: m for m in http.get("/v1/models").json()["data"]}
    assert listed[model_id]["custom_metadata"] == {
        "model_type": "llm",
        "provider_id": "peregrine",
        "provider_resource_id": model_id,
    }
    meta = listed[embedding_id]["custom_metadata"]
    assert (meta["model_type"], meta["embedding_dimension"], meta["provider_resource_id"]) == (
        "embedding",
        384,
        embedding_id,
    )


@pytest.mark.parametrize("which", ["llm", "embedding"])
def test_model_detail_has_both_shapes(
    http: httpx.Client, model_id: str, embedding_id: str, which: str
) -> None:
    name = model_id if which == "llm" else embedding_id
    one = http.get(f"/v1/models/{name}").json()
    assert (one["id"], one["object"]) == (name, "model")  # OpenAI
    assert (one["identifier"], one["provider_resource_id"], one["type"], one["model_type"]) == (
        name,
        name,
        "model",
        which,
    )
    assert one["provider_id"] == "peregrine" and isinstance(one["metadata"], dict)


def test_sdk_models(client: openai.OpenAI, model_id: str, embedding_id: str) -> None:
    assert {m.id for m in client.models.list()} == {model_id, embedding_id}
    assert client.models.retrieve(embedding_id).id == embedding_id
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")


def test_sdk_embeddings_match_sentence_transformers(client: openai.OpenAI, embedding_id: str) -> None:
    st = pytest.importorskip("sentence_transformers")
    from models.embedder import resolve_embedding_model

    reference = st.SentenceTransformer(
        str(resolve_embedding_model("bundled:all-minilm-l6-v2")[0]), device="cpu"
    )
    expected = reference.encode(TEXTS, convert_to_numpy=True)
    floats = client.embeddings.create(model=embedding_id, input=TEXTS, encoding_format="float")
    packed = client.embeddings.create(
        model=embedding_id, input=TEXTS
    )  # the SDK asks for base64 and decodes it
    assert floats.model == embedding_id and floats.usage.prompt_tokens > len(TEXTS)
    for got in (floats, packed):
        vectors = [d.embedding for d in sorted(got.data, key=lambda d: d.index)]
        assert [len(v) for v in vectors] == [384] * len(TEXTS)
        for mine, theirs in zip(vectors, expected, strict=True):
            assert cosine(mine, theirs.tolist()) > 0.999


def test_sdk_embedding_dimensions_and_errors(client: openai.OpenAI, model_id: str, embedding_id: str) -> None:
    full = (
        client.embeddings.create(model=embedding_id, input="falcon", encoding_format="float")
        .data[0]
        .embedding
    )
    short = client.embeddings.create(model=embedding_id, input="falcon", dimensions=32).data[0].embedding
    assert len(short) == 32 and math.isclose(sum(x * x for x in short), 1.0, rel_tol=1e-4)
    assert cosine(short, full[:32]) > 0.9999
    with pytest.raises(openai.BadRequestError):
        client.embeddings.create(model=embedding_id, input="falcon", dimensions=999)
    with pytest.raises(openai.BadRequestError):
        client.embeddings.create(model=model_id, input="falcon")  # the LLM does not embed
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="nope", input="falcon")


def chat(client: openai.OpenAI, model_id: str, max_tokens: int = 12, **kwargs):
    messages = [{"role": "user", "content": "Write a sentence about rivers."}]
    return client.chat.completions.create(model=model_id, messages=messages, max_tokens=max_tokens, **kwargs)


def test_top_level_sampling_keys_are_honoured(client: openai.OpenAI, model_id: str) -> None:
    greedy = chat(client, model_id, temperature=0).choices[0].message.content
    # top_k 1 and min_p 1 each leave only the most likely token: hot sampling must still give greedy text
    assert (
        chat(client, model_id, temperature=1.5, extra_body={"top_k": 1}).choices[0].message.content == greedy
    )
    assert (
        chat(client, model_id, temperature=1.5, extra_body={"min_p": 1.0}).choices[0].message.content
        == greedy
    )
    long = chat(client, model_id, temperature=0, max_tokens=40, extra_body={"ignore_eos": True})
    assert (long.usage.completion_tokens, long.choices[0].finish_reason) == (40, "length")
    penalised = chat(client, model_id, temperature=0, extra_body={"repetition_penalty": 1.3})
    assert penalised.choices[0].message.content  # accepted (a 400 would raise)
