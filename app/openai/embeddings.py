"""`POST /v1/embeddings` (OpenAI shape; what Llama Stack 0.3+ and its `remote::vllm` provider call).

The embedding model is loaded by `main.py` beside the LLM (`--embedding-model`, default the bundled
all-MiniLM-L6-v2) and handed to `create_app(..., embedder=...)`. A request's inputs are embedded together,
in padded batches, on a worker thread so the event loop keeps streaming other answers meanwhile.
"""

from __future__ import annotations

import base64
import time
from typing import Any, Literal

import anyio
import numpy as np
from fastapi import APIRouter, Request
from pydantic import BaseModel, Field

from app.errors import BadRequestError, NotFoundError, ServiceUnavailableError
from app.llama_stack.schemas import native_model_fields
from app.openai.schemas import ModelCard
from models.embedder import EMBED_SUFFIX, Embedder, EmbeddingResult

router = APIRouter(prefix="/v1", tags=["openai"])
STARTED_AT = int(time.time())
MAX_INPUTS = 2048


class EmbeddingRequest(BaseModel):
    model: str | None = Field(None, description="The embedding model's id (see GET /v1/models). Optional.")
    input: str | list[str] | list[int] | list[list[int]] = Field(
        ..., description="A text or a list of texts."
    )
    encoding_format: Literal["float", "base64"] = Field("float", description="base64: little-endian float32.")
    dimensions: int | None = Field(None, ge=1, description="Keep the first N components, re-normalised.")
    user: str | None = None


class EmbeddingData(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[EmbeddingData]
    model: str
    usage: EmbeddingUsage


def embedder_names(request: Request, embedder: Embedder) -> list[str]:
    """The served id first, then the short name, the name without the "-embed" that `discoverable_name` adds,
    and the setting's value, which clients may also send."""
    plain = embedder.name.removesuffix(EMBED_SUFFIX)
    names = [embedder.name, embedder.name.rsplit("/", 1)[-1], plain, plain.rsplit("/", 1)[-1]]
    setting = getattr(request.app.state.settings, "embedding_model", None)
    return names + ([str(setting)] if setting else [])


def get_embedder(request: Request, model: str | None) -> Embedder:
    """The embedder `model` names (None: the one there is). 404 for an unknown name, 400 for the LLM."""
    embedder: Embedder | None = getattr(request.app.state, "embedder", None)
    if embedder is None:
        setting = str(getattr(request.app.state.settings, "embedding_model", "") or "").strip().lower()
        if setting in ("", "none", "off"):  # turned off for good: not a passing unavailability
            raise NotFoundError(
                "This server serves no embedding model (it was started with --embedding-model none).",
                param="model",
                code="model_not_found",
            )
        raise ServiceUnavailableError("The embedding model is still loading; retry shortly.")
    if model is None or model.lower() in {n.lower() for n in embedder_names(request, embedder)}:
        return embedder
    engine = getattr(request.app.state, "engine", None)
    if engine is not None and model == engine.model_name:
        raise BadRequestError(
            f"The model '{model}' is a text generation model; embeddings come from '{embedder.name}'.",
            param="model",
            code="model_not_embedding",
        )
    raise NotFoundError(
        f"The model '{model}' does not exist. The embedding model is '{embedder.name}'.",
        param="model",
        code="model_not_found",
    )


async def run_embed(
    embedder: Embedder, texts: list[str], dimensions: int | None, *, strict_length: bool = False, param: str
) -> EmbeddingResult:
    """Embed on a worker thread. `strict_length` refuses texts longer than the model reads (else they are
    truncated, as sentence-transformers does)."""
    if dimensions is not None and dimensions > embedder.dimension:
        raise BadRequestError(
            f"dimensions must be at most {embedder.dimension} for '{embedder.name}', got {dimensions}.",
            param="dimensions",
        )
    if strict_length:
        lengths = await anyio.to_thread.run_sync(lambda: embedder.token_counts(texts, truncate=False))
        too_long = [i for i, n in enumerate(lengths) if n > embedder.max_seq_length]
        if too_long:
            raise BadRequestError(
                f"{param}[{too_long[0]}] has {lengths[too_long[0]]} tokens; '{embedder.name}' reads at most "
                f"{embedder.max_seq_length}.",
                param=param,
                code="context_length_exceeded",
            )
    return await anyio.to_thread.run_sync(embedder.encode, texts, dimensions)


def _texts(value: str | list[str] | list[int] | list[list[int]]) -> list[str]:
    if isinstance(value, str):
        return [value]
    if not value:
        raise BadRequestError("input must not be empty.", param="input")
    if not all(isinstance(v, str) for v in value):
        raise BadRequestError("Token-id input is not supported for embeddings; send text.", param="input")
    if len(value) > MAX_INPUTS:
        raise BadRequestError(f"At most {MAX_INPUTS} inputs per request, got {len(value)}.", param="input")
    return list(value)  # type: ignore[arg-type]


def _encode(vector: list[float], fmt: str) -> list[float] | str:
    if fmt == "float":
        return vector
    return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")


@router.post("/embeddings", response_model=EmbeddingResponse)
async def create_embeddings(body: EmbeddingRequest, request: Request) -> EmbeddingResponse:
    """Embeddings (OpenAI `POST /v1/embeddings`).

    `input` is a string or a list of up to 2048 strings, embedded together in batches. `encoding_format`
    `base64` returns little-endian float32 bytes; `dimensions` keeps the first N components and
    re-normalises them. Texts longer than the model's window (256 tokens for all-MiniLM-L6-v2) are
    truncated, as sentence-transformers does; `usage.prompt_tokens` counts the tokens actually read.
    """
    embedder = get_embedder(request, body.model)
    result = await run_embed(embedder, _texts(body.input), body.dimensions, param="input")
    data = [
        EmbeddingData(index=i, embedding=_encode(v, body.encoding_format))
        for i, v in enumerate(result.vectors)
    ]
    usage = EmbeddingUsage(prompt_tokens=result.prompt_tokens, total_tokens=result.prompt_tokens)
    return EmbeddingResponse(data=data, model=embedder.name, usage=usage)


def embedding_cards(request: Request) -> list[ModelCard]:
    """The embedding model as a `/v1/models` entry, OpenAI and Llama Stack fields both (empty when none)."""
    embedder: Embedder | None = getattr(request.app.state, "embedder", None)
    if embedder is None:
        return []
    metadata = {"embedding_dimension": embedder.dimension, "context_length": embedder.max_seq_length}
    custom = {"model_type": "embedding", "provider_id": "peregrine", "provider_resource_id": embedder.name}
    card = ModelCard(
        id=embedder.name,
        created=STARTED_AT,
        max_model_len=embedder.max_seq_length,
        custom_metadata=custom | metadata,
        **native_model_fields(embedder.name, "embedding", metadata),
    )
    return [card]


def embedding_model_detail(request: Request, model_id: str) -> dict[str, Any] | None:
    """`GET /v1/models/{id}` for the embedding model (the same union entry); None if `model_id` does not
    name it."""
    embedder: Embedder | None = getattr(request.app.state, "embedder", None)
    if embedder is None or model_id.lower() not in {n.lower() for n in embedder_names(request, embedder)}:
        return None
    return embedding_cards(request)[0].model_dump()
