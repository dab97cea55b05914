"""Pydantic wire models of OpenAI's Responses API (`POST /v1/responses`): the request as clients send it.

What is served: `input` (a string, or a list of items: messages with `input_text` / `output_text` parts,
`function_call` and `function_call_output` items, `reasoning` items, which are dropped), `instructions`,
`max_output_tokens`, `temperature`, `top_p`, `seed`, vLLM's extra sampling keys at top level, `text.format`
(`text`, `json_object`, `json_schema`), function `tools`, `tool_choice`, `parallel_tool_calls`, `reasoning`,
`store`, `metadata`, `previous_response_id`, `stream`. Fields that change nothing on this server
(`include`, `truncation`, `user`, `service_tier`, `prompt_cache_key`, `safety_identifier`, `background: false`,
`top_logprobs`, ...) are accepted and ignored. Items are checked in `app/responses/convert.py`, where an error
can name the item (`input[2].content[0]`).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

MAX_ITEMS = 4096
MAX_METADATA = 16


class InputItem(BaseModel):
    """One `input` item. Its `type` says which fields matter; a message may omit `type`."""

    model_config = ConfigDict(extra="allow")
    type: str | None = None
    role: str | None = None
    content: str | list[dict[str, Any]] | None = None
    id: str | None = None
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    output: str | list[dict[str, Any]] | None = None
    status: str | None = None


class TextFormat(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="allow")
    format: TextFormat | None = None


class Tool(BaseModel):
    """A tool. Only `function` tools run here; hosted ones (`web_search`, `file_search`, ...) are a 400."""

    model_config = ConfigDict(extra="allow")
    type: str
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str
    name: str | None = None


class ReasoningConfig(BaseModel):
    model_config = ConfigDict(extra="allow")
    effort: str | None = None
    summary: str | None = None


class ResponsesRequest(BaseModel):
    model: str | None = Field(None, description="The served model id (see GET /v1/models). Optional.")
    input: str | list[InputItem] = Field(..., description="A string (one user message) or a list of items.")
    instructions: str | None = Field(None, description="A system message for this turn (not carried over).")
    previous_response_id: str | None = Field(None, description="Continue the conversation of a stored response.")
    max_output_tokens: int | None = Field(None, ge=1, description="Omitted: the rest of the context.")
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    seed: int | None = None
    text: TextConfig | None = None
    tools: list[Tool] | None = Field(None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    reasoning: ReasoningConfig | None = None
    store: bool = Field(True, description="Keep the response for GET and previous_response_id (default true).")
    metadata: dict[str, str] | None = None
    stream: bool = False
    background: bool = False
    # vLLM's extra sampling keys
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    stop: str | list[str] | None = None
    ignore_eos: bool | None = None
    min_tokens: int | None = Field(None, ge=0)
    keep_alive: float | str | None = None

    @field_validator("input")
    @classmethod
    def _bounded_input(cls, value: str | list[InputItem]) -> str | list[InputItem]:
        if isinstance(value, list) and not 0 < len(value) <= MAX_ITEMS:
            raise ValueError(f"input must hold 1 to {MAX_ITEMS} items")
        return value

    @field_validator("metadata")
    @classmethod
    def _bounded_metadata(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        if value is not None and len(value) > MAX_METADATA:
            raise ValueError(f"metadata may hold at most {MAX_METADATA} keys")
        return value

    @field_validator("background")
    @classmethod
    def _not_background(cls, value: bool) -> bool:
        if value:
            raise ValueError("background responses are not supported; send background: false")
        return value


class DeletedResponse(BaseModel):
    id: str
    object: Literal["response"] = "response"
    deleted: bool = True
