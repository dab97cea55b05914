"""Pydantic wire models of Ollama's API (the requests; answers are built as plain dicts in `convert.py`).

Field names are Ollama's (docs.ollama.com/api). Unknown top-level keys and unknown `options` are ignored, as
Ollama ignores them (it logs a warning); a known field of the wrong type is a 400 naming it. Sampling ranges are
checked where the request becomes Peregrine's (the OpenAI chat form), so the messages name Ollama's fields.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

KeepAlive = float | str | None
Format = Literal["", "json"] | dict[str, Any] | None


class Options(BaseModel):
    """The model options Peregrine serves; the rest of Ollama's (num_gpu, num_thread, mirostat, ...) are ignored."""

    model_config = ConfigDict(extra="allow")
    num_predict: int | None = Field(None, description="Most tokens to generate; -1 or -2: the rest of the context.")
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: list[str] | None = None
    repeat_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    num_ctx: int | None = Field(
        None, description="Accepted; the context window is the server's (--max-model-len), fixed at load."
    )


class ToolCallFunction(BaseModel):
    name: str
    arguments: dict[str, Any] | str = Field(default_factory=dict)


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="allow")
    function: ToolCallFunction


class Message(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "user", "assistant", "tool"]
    content: str | None = ""
    thinking: str | None = None
    images: list[str] | None = None
    tool_calls: list[ToolCall] | None = None
    tool_name: str | None = None


class ToolFunction(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["function"] = "function"
    function: ToolFunction


class GenerationRequest(BaseModel):
    """What /api/chat and /api/generate share."""

    model_config = ConfigDict(extra="allow")
    model: str = Field(..., min_length=1)
    stream: bool = Field(True, description="Ollama streams unless told not to.")
    format: Format = Field(None, description='"json", or a JSON Schema the answer must match.')
    options: Options | None = None
    keep_alive: KeepAlive = Field(None, description='How long the model stays loaded: "5m", seconds; 0 unloads.')
    think: bool | Literal["low", "medium", "high"] | None = None


class ChatRequest(GenerationRequest):
    messages: list[Message] | None = None
    tools: list[Tool] | None = None
    tool_choice: Any = Field(
        None, description="Peregrine's extension (OpenAI's tool_choice: none, auto, required, or a named function)."
    )


class GenerateRequest(GenerationRequest):
    prompt: str | None = None
    suffix: str | None = None
    system: str | None = None
    template: str | None = None
    context: list[int] | None = Field(None, description="Token ids of an earlier answer's context, prepended.")
    raw: bool = False
    images: list[str] | None = None


class EmbedRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str = Field(..., min_length=1)
    input: str | list[str]
    truncate: bool = True
    dimensions: int | None = Field(None, ge=1)
    options: Options | None = None
    keep_alive: KeepAlive = None


class EmbeddingsRequest(BaseModel):
    """The older /api/embeddings: one prompt, one `embedding`."""

    model_config = ConfigDict(extra="allow")
    model: str = Field(..., min_length=1)
    prompt: str
    options: Options | None = None
    keep_alive: KeepAlive = None


class ModelRequest(BaseModel):
    """/api/show and /api/delete; `name` is the older spelling of `model`."""

    model_config = ConfigDict(extra="allow")
    model: str | None = None
    name: str | None = None
    verbose: bool = False

    @property
    def target(self) -> str | None:
        return self.model or self.name


class PullRequest(ModelRequest):
    insecure: bool = False
    stream: bool = True
