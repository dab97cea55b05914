"""Pydantic wire models of the legacy Llama Stack inference API (`/inference/*`, `/alpha/inference/*`,
`/v1/inference/*`), as llama-stack-client 0.0.x to 0.2.x send and read them.

Requests accept every shape those clients sent: `model` (<= 0.0.50) or `model_id` (later);
`sampling_params.strategy` as a bare string with `temperature` / `top_p` / `top_k` beside it (0.0.x) or
as a tagged union (0.1.x); message content as a string, one content item, or a list of items or strings;
tool results with role `tool` (0.1.x) or `ipython` (0.0.x). Unknown keys are ignored, as the Llama Stack
server did. Responses are built as plain dicts in `app/llama_stack/convert.py`: their shapes (with the
0.0.x bare-string stream delta) are documented there, next to the code that writes them.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

# ---------------------------------------------------------------- content


class ContentItem(BaseModel):
    """`{"type": "text", "text": ...}`; images (`{"type": "image", ...}`, 0.0.x `ImageMedia`) parse but
    are refused by the converter with a 400, since the served models read text only."""

    model_config = ConfigDict(extra="allow")
    type: str = "text"
    text: str | None = None


Content = str | ContentItem | list[str | ContentItem]


# ---------------------------------------------------------------- sampling


class GreedyStrategy(BaseModel):
    type: Literal["greedy"] = "greedy"


class TopPStrategy(BaseModel):
    type: Literal["top_p"]
    temperature: float | None = Field(None, ge=0.0)
    top_p: float | None = Field(0.95, gt=0.0, le=1.0)


class TopKStrategy(BaseModel):
    type: Literal["top_k"]
    top_k: int = Field(..., ge=0)


Strategy = Annotated[GreedyStrategy | TopPStrategy | TopKStrategy, Field(discriminator="type")]


class LegacySamplingParams(BaseModel):
    """0.1.x: `strategy` is a tagged union. 0.0.x: `strategy` is a bare string and `temperature`,
    `top_p`, `top_k` sit beside it. `max_tokens: 0` means "the server's default" (the rest of the context)."""

    model_config = ConfigDict(extra="ignore")
    strategy: Literal["greedy", "top_p", "top_k"] | Strategy = "greedy"
    temperature: float | None = Field(None, ge=0.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0)
    max_tokens: int | None = Field(0, ge=0)
    repetition_penalty: float | None = Field(1.0, gt=0.0)
    stop: list[str] | None = None


class LogprobsConfig(BaseModel):
    top_k: int = Field(0, ge=0, le=20, description="Alternatives returned per generated token.")


# ---------------------------------------------------------------- messages


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="allow")
    call_id: str
    tool_name: str | dict[str, Any]
    arguments: dict[str, Any] | str = Field(default_factory=dict)


class Message(BaseModel):
    """Any message: system, user, assistant (a `CompletionMessage` in Llama Stack's words), or a tool
    result (`tool` since 0.1.0, `ipython` before) carrying `call_id` and `tool_name`."""

    model_config = ConfigDict(extra="allow")
    role: Literal["system", "user", "assistant", "tool", "ipython"]
    content: Content = ""
    call_id: str | None = None
    tool_name: str | dict[str, Any] | None = None
    tool_calls: list[ToolCall] | None = None
    stop_reason: str | None = None


# ---------------------------------------------------------------- requests


class ModelRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model_id: str | None = Field(None, description="The served model id (llama-stack-client >= 0.0.51).")
    model: str | None = Field(None, description="The same, as llama-stack-client <= 0.0.50 named it.")

    @property
    def model_name(self) -> str | None:
        return self.model_id or self.model


class GenerationRequest(ModelRequest):
    sampling_params: LegacySamplingParams = Field(default_factory=LegacySamplingParams)
    response_format: dict[str, Any] | None = Field(
        None, description='{"type": "json_schema", "json_schema": {...}} or {"type": "grammar", "bnf": GBNF}: the '
        "answer is constrained to match.",
    )
    stream: bool = False
    logprobs: LogprobsConfig | None = None


class ChatCompletionRequest(GenerationRequest):
    messages: list[Message] = Field(..., min_length=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    tool_prompt_format: Any = None
    tool_config: dict[str, Any] | None = None


class CompletionRequest(GenerationRequest):
    content: Content


class BatchChatCompletionRequest(GenerationRequest):
    messages_batch: list[list[Message]] = Field(..., min_length=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    tool_prompt_format: Any = None
    tool_config: dict[str, Any] | None = None


class BatchCompletionRequest(GenerationRequest):
    content_batch: list[Content] = Field(..., min_length=1)


class EmbeddingsRequest(ModelRequest):
    contents: list[Content] = Field(..., min_length=1)
    output_dimension: int | None = Field(None, ge=1)
    text_truncation: Literal["none", "start", "end"] | None = None
    task_type: str | None = None


# ---------------------------------------------------------------- models


def native_model_fields(identifier: str, model_type: str, metadata: dict[str, Any]) -> dict[str, Any]:
    """Llama Stack's own model fields (the `Model` of clients <= 0.2.x, `models.retrieve` of 0.3+), served
    beside OpenAI's in `/v1/models` entries so every client reads the same entry."""
    return {
        "identifier": identifier,
        "provider_resource_id": identifier,
        "provider_id": "peregrine",
        "type": "model",
        "metadata": metadata,
        "model_type": model_type,
    }
