"""Pydantic wire models of Anthropic's Messages API (`POST /v1/messages`, `POST /v1/messages/count_tokens`).

Blocks are a union discriminated by `type`, so an unknown block type is a 400 that names it. Fields real clients
send that change nothing here (`metadata`, `cache_control`, `citations`, `service_tier`, Claude Code's
`context_management` and the like) are accepted and ignored. Range checks live here; what needs the model
(context length, the tools' grammar) is checked on the way to the engine.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

MAX_STOP_SEQUENCES = 16  # as the OpenAI routes: each is checked at every generated token
MAX_TOOLS = 128


class _Block(BaseModel):
    model_config = ConfigDict(extra="allow")  # cache_control, citations: accepted, no meaning here


class TextBlock(_Block):
    type: Literal["text"]
    text: str


class ImageBlock(_Block):
    type: Literal["image"]
    source: dict[str, Any]


class ToolUseBlock(_Block):
    type: Literal["tool_use"]
    id: str = Field(..., min_length=1)
    name: str = Field(..., min_length=1)
    input: dict[str, Any]


class ToolResultBlock(_Block):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[Annotated[TextBlock | ImageBlock, Field(discriminator="type")]] | None = None
    is_error: bool = False


class ThinkingBlock(_Block):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(_Block):
    type: Literal["redacted_thinking"]
    data: str


ContentBlock = Annotated[
    TextBlock | ImageBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | RedactedThinkingBlock,
    Field(discriminator="type"),
]


BLOCK_TYPES = ("text", "image", "tool_use", "tool_result", "thinking", "redacted_thinking")


class InputMessage(BaseModel):
    """A turn. `system` turns mid-conversation (Claude Code's `mid-conversation-system` beta) are served as system
    messages; they may hold text only."""

    role: Literal["user", "assistant", "system"]
    content: str | list[ContentBlock]

    @field_validator("content", mode="before")
    @classmethod
    def _known_blocks(cls, content: Any) -> Any:
        """One clear message for an unknown block type (pydantic's union errors list every alternative)."""
        for j, block in enumerate(content if isinstance(content, list) else ()):
            kind = block.get("type") if isinstance(block, dict) else None
            if kind not in BLOCK_TYPES:
                raise ValueError(f"block {j} has type {kind!r}; known block types: {', '.join(BLOCK_TYPES)}")
        return content


class Tool(BaseModel):
    """A client tool. Anthropic's server tools (`web_search_...`, `bash_...`: a `type` other than `custom`) are
    refused with a 400 naming them: a local server cannot run them."""

    model_config = ConfigDict(extra="allow")
    name: str = Field(..., pattern=r"^[A-Za-z0-9_.\-]{1,64}$", description="Letters, digits, _ . -; at most 64.")
    description: str | None = None
    input_schema: dict[str, Any] | None = Field(None, description="A JSON Schema of the tool's input object.")
    type: str | None = None


class ToolChoiceAuto(BaseModel):
    type: Literal["auto"]
    disable_parallel_tool_use: bool = False


class ToolChoiceAny(BaseModel):
    type: Literal["any"]
    disable_parallel_tool_use: bool = False


class ToolChoiceTool(BaseModel):
    type: Literal["tool"]
    name: str
    disable_parallel_tool_use: bool = False


class ToolChoiceNone(BaseModel):
    type: Literal["none"]


ToolChoice = Annotated[ToolChoiceAuto | ToolChoiceAny | ToolChoiceTool | ToolChoiceNone, Field(discriminator="type")]


class ThinkingConfig(BaseModel):
    """Accepted in every form; a reasoning model's thinking comes back as `thinking` blocks whatever it says (the
    server's `--reasoning-parser` decides), and `budget_tokens` is not enforced apart from `max_tokens`."""

    model_config = ConfigDict(extra="allow")
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = Field(None, ge=0)


class _Conversation(BaseModel):
    """What both routes read: the conversation and the tools (count_tokens counts exactly this)."""

    model: str = Field(..., min_length=1, description="The served model id (see GET /v1/models).")
    messages: list[InputMessage] = Field(..., min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None


class MessagesRequest(_Conversation):
    max_tokens: int = Field(..., ge=1, description="Required, as in Anthropic's API.")
    stop_sequences: list[Annotated[str, Field(max_length=256)]] | None = Field(None, max_length=MAX_STOP_SEQUENCES)
    temperature: float | None = Field(None, ge=0.0, le=1.0, description="0 is greedy. Default 1.")
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0)
    metadata: dict[str, Any] | None = None
    stream: bool = False


class CountTokensRequest(_Conversation):
    pass


# ---------------------------------------------------------------- responses


class Usage(BaseModel):
    input_tokens: int = Field(..., description="Prompt tokens computed for this request (not from the cache).")
    output_tokens: int
    cache_creation_input_tokens: int = 0
    cache_read_input_tokens: int = Field(0, description="Prompt tokens whose KV came from the prefix cache.")


StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]


class Message(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[dict[str, Any]]
    stop_reason: StopReason | None
    stop_sequence: str | None = None
    usage: Usage


class TokenCount(BaseModel):
    input_tokens: int


class AnthropicErrorDetail(BaseModel):
    type: str = Field(..., description="invalid_request_error, authentication_error, permission_error, "
                      "not_found_error, request_too_large, rate_limit_error, api_error, overloaded_error, ...")
    message: str


class AnthropicErrorResponse(BaseModel):
    """Anthropic's error envelope, on every error these routes answer."""

    type: Literal["error"] = "error"
    error: AnthropicErrorDetail
    request_id: str | None = None


ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    status: {"model": AnthropicErrorResponse, "description": text}
    for status, text in ((400, "Invalid request (Anthropic's error envelope)"), (404, "Unknown model"),
                         (413, "Body too large"), (429, "Rate limited"))
}
