"""Pydantic wire models of the OpenAI-compatible API: what clients send and what they get back.

Requests accept the OpenAI fields plus vLLM's extra sampling keys at top level (`top_k`, `min_p`,
`repetition_penalty`, `ignore_eos`, `min_tokens`, `stop_token_ids`, `skip_special_tokens`,
`include_stop_str_in_output`), because that is where OpenAI SDK `extra_body` and Llama Stack's
`remote::vllm` provider put them. Unknown keys are ignored (clients send many that do not change a
text-only answer). `tools`, `tool_choice` and `parallel_tool_calls` are served (`app/chat/tools.py`), and so are
the structured output fields (`response_format`, vLLM's `structured_outputs` and `guided_*`, llama.cpp's
`grammar` and `json_schema`; `app/chat/structured.py`). Range checks live here, so a bad value is a 400 that
names the field; checks that need the model (vocabulary, context length) live in
`app/openai/convert.py`.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_serializer

MAX_STOP = 16  # stop strings per request: each is checked at every generated token
MAX_STOP_CHARS = 256
MAX_STOP_TOKEN_IDS = 256
MAX_PROMPTS = 128  # prompts in one completions request: each becomes an engine request

# ---------------------------------------------------------------- requests


class StreamOptions(BaseModel):
    include_usage: bool = False


class ContentPart(BaseModel):
    """One part of a message's content. Only `{"type": "text", "text": ...}` can be served."""

    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool", "function", "ipython"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[dict[str, Any]] | None = None

    @field_validator("tool_calls")
    @classmethod
    def _calls_name_functions(cls, calls: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
        for call in calls or []:
            function = call.get("function")
            if not isinstance(function, dict) or not isinstance(function.get("name"), str):
                raise ValueError('each tool call needs "function": {"name": ..., "arguments": ...}')
        return calls


class SamplingRequest(BaseModel):
    """The sampling and stopping fields both endpoints share."""

    model: str | None = Field(None, description="The served model id (see GET /v1/models). Optional.")
    max_tokens: int | None = Field(None, ge=1, description="Omitted: the rest of the context.")
    temperature: float | None = Field(None, ge=0.0, le=2.0, description="0 is greedy; at most 2. Default 1.")
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    n: int = Field(1, ge=1, le=128)
    stop: str | list[str] | None = Field(
        None, description=f"Up to {MAX_STOP} stop strings, each at most {MAX_STOP_CHARS} characters."
    )
    seed: int | None = None
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = Field(
        None, description="Token id (as a string) -> bias in [-100, 100]."
    )
    user: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # vLLM's extra sampling keys
    top_k: int | None = Field(None, ge=-1, description="-1 or 0: off.")
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0)
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    stop_token_ids: list[int] | None = Field(None, max_length=MAX_STOP_TOKEN_IDS)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    prompt_logprobs: int | None = Field(
        None, ge=0, le=20,
        description="vLLM's extra: the logprob of every prompt token (null for the first) plus this many "
        "alternatives, computed from the prefill; returned as `prompt_logprobs` (per choice for completions, "
        "top level for chat), each entry {token id: {logprob, rank, decoded_token}}.",
    )  # fmt: skip
    keep_alive: float | str | None = Field(
        None,
        description="Ollama's keep_alive, when the server serves several models: how long the model stays loaded "
        "after this request (30s, 5m, 1h, or seconds; 0 unloads it at once, negative keeps it loaded).",
    )
    # structured output (app/chat/structured.py): at most one of these; the answer is constrained to match it
    response_format: Any = Field(
        None, description="OpenAI's: {type: text}, {type: json_object}, or {type: json_schema, json_schema: "
        "{name, schema, strict}}. The answer is constrained token by token to match.",
    )
    structured_outputs: Any = Field(
        None, description="vLLM's: exactly one of json (a JSON Schema), regex, choice (strings), grammar "
        "(GBNF or Lark), json_object (true).",
    )
    guided_json: Any = Field(None, description="vLLM's older field: a JSON Schema (object or JSON text).")
    guided_regex: str | None = Field(None, description="vLLM's older field: a regular expression.")
    guided_choice: Any = Field(None, description="vLLM's older field: the answer is one of these strings.")
    guided_grammar: str | None = Field(None, description="vLLM's older field: a GBNF (or Lark) grammar.")
    grammar: str | None = Field(None, description="llama.cpp's: a GBNF grammar.")
    json_schema: Any = Field(None, description="llama.cpp's: a JSON Schema the answer must match.")

    @field_validator("stop")
    @classmethod
    def _bounded_stop(cls, stop: str | list[str] | None) -> str | list[str] | None:
        strings = [stop] if isinstance(stop, str) else stop or []
        if len(strings) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop strings are allowed, got {len(strings)}")
        if any(len(s) > MAX_STOP_CHARS for s in strings):
            raise ValueError(f"a stop string may be at most {MAX_STOP_CHARS} characters long")
        return stop


class FunctionDefinition(BaseModel):
    name: str = Field(..., pattern=r"^[A-Za-z0-9_.\-]{1,64}$", description="Letters, digits, _ . -; at most 64.")
    description: str | None = None
    parameters: dict[str, Any] | None = Field(None, description="A JSON Schema of the arguments object.")
    strict: bool | None = None


class ToolDefinition(BaseModel):
    type: Literal["function"] = Field(..., description="Only function tools can be served.")
    function: FunctionDefinition


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: NamedFunction


MAX_TOOLS = 128
MAX_TEMPLATE_KWARGS = 32
# what the server itself gives apply_chat_template (a request's chat_template_kwargs cannot replace them)
TEMPLATE_INPUTS = {"messages", "conversation", "tools", "documents", "add_generation_prompt", "continue_final_message",
                   "tokenize", "return_dict", "return_tensors", "chat_template", "tokenizer_kwargs"}


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(..., min_length=1)
    tools: list[ToolDefinition] | None = Field(
        None, max_length=MAX_TOOLS, description="Functions the model may call (see tool_choice)."
    )
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None, description="none: never call (tools stay in the prompt); auto (default with tools): the model "
        "decides, a started call is constrained valid; required: at least one call; a named function: exactly "
        "that one. required and named calls are constrained from the first token.",
    )
    parallel_tool_calls: bool | None = Field(None, description="false: at most one call. Default true.")
    reasoning_effort: Literal["minimal", "low", "medium", "high"] | None = Field(
        None, description="Passed to the chat template as `reasoning_effort` (gpt-oss's reads it; others ignore it).")
    chat_template_kwargs: dict[str, Any] | None = Field(
        None, description="Extra variables for the chat template (vLLM's extension), e.g. "
        '{"enable_thinking": false} for Qwen3. The template\'s own inputs (messages, tools, add_generation_prompt, '
        "...) cannot be set this way.",
    )

    @field_validator("chat_template_kwargs")
    @classmethod
    def _not_the_templates_inputs(cls, kwargs: dict[str, Any] | None) -> dict[str, Any] | None:
        taken = sorted(set(kwargs or {}) & TEMPLATE_INPUTS)
        if taken:
            raise ValueError(f"chat_template_kwargs cannot set {', '.join(taken)}: the server renders those")
        if kwargs is not None and len(kwargs) > MAX_TEMPLATE_KWARGS:
            raise ValueError(f"chat_template_kwargs takes at most {MAX_TEMPLATE_KWARGS} keys")
        return kwargs
    max_completion_tokens: int | None = Field(None, ge=1, description="Alias of max_tokens; wins if both.")
    store: bool | None = Field(None, description="Keep this completion (GET /v1/chat/completions/{id}); default: "
                               "the server's --store-chat-completions (off).")
    metadata: dict[str, str] | None = Field(None, max_length=16, description="Up to 16 string pairs, stored with it.")
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)


PromptInput = str | list[str] | list[int] | list[list[int]]


class CompletionRequest(SamplingRequest):
    prompt: PromptInput = Field(..., description="A string, strings, token ids, or lists of token ids.")
    max_tokens: int | None = Field(
        None, ge=0, description="Omitted: the rest of the context. 0 (only with echo): score the prompt, generate "
        "nothing.",
    )
    logprobs: bool | int | None = Field(
        None, description="0-20 alternatives per token (true means 1). With echo, the prompt tokens are "
        "covered too (null for the first).",
    )
    echo: bool = Field(False, description="Prepend the prompt to each choice's text (and to its logprobs).")
    best_of: int | None = Field(None, ge=1)
    suffix: str | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_shape(cls, prompt: Any) -> Any:
        """One clear message for a prompt of the wrong shape (pydantic's union errors list four)."""
        if isinstance(prompt, str):
            return prompt
        if not isinstance(prompt, list) or not (
            all(isinstance(p, str) for p in prompt)
            or all(_is_token_id(p) for p in prompt)
            or all(isinstance(p, list) and all(_is_token_id(t) for t in p) for p in prompt)
        ):
            raise ValueError(
                "prompt must be a string, a list of strings, a list of token ids (integers), "
                "or a list of lists of token ids"
            )
        if prompt and not _is_token_id(prompt[0]) and len(prompt) > MAX_PROMPTS:
            raise ValueError(f"at most {MAX_PROMPTS} prompts per request, got {len(prompt)}")
        return prompt


def _is_token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# ---------------------------------------------------------------- responses


class PromptTokensDetails(BaseModel):
    """Where the prompt tokens came from."""

    cached_tokens: int = Field(
        0,
        description="Prompt tokens whose KV cache was reused from an earlier request (automatic prefix caching, "
        "in whole blocks) instead of being computed; per prompt, as its first choice found them.",
    )


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class TopLogprobOut(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprobOut(TopLogprobOut):
    top_logprobs: list[TopLogprobOut]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprobOut] | None


class FunctionCall(BaseModel):
    name: str
    arguments: str = Field(..., description="The arguments as JSON text.")


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCallOut] = Field(default_factory=list)
    reasoning_content: str | None = Field(
        None, description="A reasoning model's thinking (between <think> and </think>), split from content by "
        "--reasoning-parser; null when there is none.",
    )
    reasoning: str | None = Field(None, description="The same as reasoning_content (vLLM's newer name).")


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    system_fingerprint: str | None = None
    prompt_logprobs: PromptLogprobs | None = None


class _DropNone(BaseModel):
    @model_serializer(mode="wrap")
    def _drop_unset(self, handler: Any) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class DeltaFunction(_DropNone):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(_DropNone):
    """OpenAI's tool-call delta: the first for a call has id, type and the name (arguments ""), the next ones
    argument fragments only; `index` says which call."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunction | None = None


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None
    reasoning_content: str | None = None  # see AssistantMessage; also sent as `reasoning`
    reasoning: str | None = None

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler: Any) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatChunkChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class PromptLogprobOut(BaseModel):
    logprob: float
    rank: int | None = None
    decoded_token: str


PromptLogprobs = list[dict[str, PromptLogprobOut] | None]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    prompt_logprobs: PromptLogprobs | None = None


class CompletionResponse(BaseModel):
    """Also the stream chunk shape (`usage` null on all but the optional last chunk)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None


class ModelCard(BaseModel):
    model_config = ConfigDict(extra="allow")  # Llama Stack's native fields ride along (native_model_fields)
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "peregrine"
    max_model_len: int | None = None
    custom_metadata: dict[str, Any] = Field(default_factory=dict)


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
