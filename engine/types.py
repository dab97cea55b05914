"""The engine's public data types: what goes in (SamplingParams) and what comes out (RequestOutput).

These are plain frozen/slotted dataclasses. The HTTP layer (`app/`) converts its pydantic wire models into
`SamplingParams` in exactly one function per API family, and converts `RequestOutput` back to the wire.
Nothing here imports torch, fastapi or pydantic.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

FinishReason = Literal["stop", "length", "abort", "error"]
"""Why a sequence ended: EOS / stop string / stop token -> "stop"; max_tokens or context end -> "length";
aborted by the caller (client gone, timeout) -> "abort"; the engine failed -> "error"."""


MAX_LOGPROBS = 20
"""The most alternatives `logprobs` / `prompt_logprobs` may ask for (the OpenAI API's bound)."""

DTYPE_BYTES: dict[str, int] = {"float32": 4, "bfloat16": 2, "float16": 2}
"""The one dtype table: the dtypes a model, its activations or its KV cache may be kept in (by torch's names), and
the bytes of one element. engine.backends.devices.DTYPES maps the names to torch dtypes; models/ imports this."""


KV_DTYPES: tuple[str, ...] = (*DTYPE_BYTES, "int8")
"""What a KV cache may be kept in: a DTYPE_BYTES dtype, or int8 (each K or V row of head_dim values with one float32
scale: engine.model.kv_cache.quantize_kv)."""


def kv_dtype_for(kv_dtype: str, model_dtype: str, quantized: bool = False) -> str:
    """The one KV dtype rule, by name: `--kv-cache-dtype kv_dtype` (a KV_DTYPES name, or auto) for a model whose
    activations are `model_dtype`. auto is the model dtype, but float16 for float32 activations over weights kept
    `quantized` (GGUF blocks on the CPU), as llama.cpp and Ollama keep theirs. The engine sizes its cache by it
    (engine.model.kv_cache.kv_cache_dtype); the preflight counts by it (models.memory.kv_cache_stored)."""
    if kv_dtype == "auto":
        return "float16" if quantized and model_dtype == "float32" else model_dtype
    if kv_dtype not in KV_DTYPES:
        raise ValueError(f"unknown kv_cache_dtype {kv_dtype!r}: use auto, {', '.join(KV_DTYPES)}")
    return kv_dtype


def kv_bytes_per_token(layers: int, kv_heads: int, head_dim: int, dtype: str) -> int:
    """The one KV arithmetic: bytes one token's keys and values take across all layers, in `dtype` (a KV_DTYPES
    name). The engine sizes its cache with it (engine.model.kv_cache.KVCacheSpec); the preflight calls it too."""
    row = head_dim + 4 if dtype == "int8" else head_dim * DTYPE_BYTES[dtype]  # int8: the values and their scale
    return 2 * layers * kv_heads * row


ConstraintKind = Literal["json_schema", "json_object", "regex", "choice", "lark", "gbnf"]


@dataclass(frozen=True, slots=True)
class Constraint:
    """What the sampled text must match: an llguidance grammar, applied token by token (engine/sampling/grammar.py).

    value: json_schema: the schema as JSON text; regex/lark/gbnf: the grammar source; choice: a JSON list of
    strings; json_object: "". trigger: lazy constraint: the text is free until this string appears in the
    output, then the text after it is constrained (as llama.cpp's lazy grammars); None: from the first token.
    """

    kind: ConstraintKind
    value: str
    trigger: str | None = None


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Per-request sampling and stopping controls. Defaults match the OpenAI API.

    temperature == 0 means greedy. top_k <= 0 means off. max_tokens None means "the rest of the context".
    logprobs None means off; 0 means the chosen token's logprob only; k > 0 adds the top-k alternatives.
    prompt_logprobs: the same for every prompt token (from the prefill; see engine/sampling/prompt_logprobs.py).
    n > 1 runs n independent sequences on the same prompt; with a seed, sequence i uses seed + i.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: Mapping[int, float] | None = None
    seed: int | None = None
    max_tokens: int | None = None
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True
    prompt_logprobs: int | None = None
    constraint: Constraint | None = None  # structured output: the text must match this grammar
    keep_prefix: bool = False  # a conversation likely to be continued: its cached KV outlives colder prefixes

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


@dataclass(frozen=True, slots=True)
class TopLogprob:
    token_id: int
    token: str
    logprob: float


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """The log-probability of one generated token, with the top-k alternatives when asked for."""

    token_id: int
    token: str
    logprob: float
    top: tuple[TopLogprob, ...] = ()


@dataclass(frozen=True, slots=True)
class PromptTokenLogprob:
    """The log-probability of one prompt token given the tokens before it; `rank` 1 is the most likely."""

    token_id: int
    token: str
    logprob: float
    rank: int
    top: tuple[TopLogprob, ...] = ()


@dataclass(slots=True)
class RequestOutput:
    """One increment of one sequence of a request, as the engine emits it.

    `text` and `token_ids` are the *new* text and tokens since the previous output of the same `index`
    (the concatenated `text` deltas equal the final decoded output; a held-back partial stop string or
    incomplete UTF-8 character is emitted later or never). The last output of a sequence has
    `finish_reason` set. `completion_tokens` counts all tokens generated so far for this index.
    `prompt_logprobs` (when asked for) rides on the first output of each sequence: one entry per prompt
    token, None for the first.
    """

    request_id: str
    index: int
    text: str
    token_ids: list[int]
    prompt_tokens: int
    completion_tokens: int
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None  # the stop string or stop token id that matched, if any
    logprobs: list[TokenLogprob] | None = None
    error: str | None = None  # set with finish_reason == "error"
    cached_tokens: int = 0  # prompt tokens whose K/V came from the prefix cache (usage.prompt_tokens_details)
    prompt_logprobs: list[PromptTokenLogprob | None] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True, slots=True)
class EngineStats:
    """A snapshot of the engine's load, read by health checks and metrics."""

    running: int
    waiting: int
    kv_used_blocks: int
    kv_total_blocks: int
    block_size: int
    preemptions_total: int
    prompt_tokens_total: int
    generated_tokens_total: int
    steps_total: int
    last_step_age_s: float  # seconds since the loop last finished a step (0 when idle and healthy)
    alive: bool
    computed_tokens_total: int = 0  # positions whose K/V the model computed (prefill, recompute, decode)
    prefix_cache_queries_total: int = 0  # tokens of admitted sequences looked up in the prefix cache
    prefix_cache_hits_total: int = 0  # of those, tokens taken from the cache instead of computed
    kv_cached_blocks: int = 0  # blocks holding a reusable prefix (in use or idle; idle ones are evictable)
    spec_proposed_tokens_total: int = 0  # speculative decoding: proposed tokens verified
    spec_accepted_tokens_total: int = 0  # of those, accepted (each one a token gained without a step of its own)

    @property
    def kv_used_tokens(self) -> int:
        return self.kv_used_blocks * self.block_size

    @property
    def kv_total_tokens(self) -> int:
        return self.kv_total_blocks * self.block_size

    @property
    def kv_usage(self) -> float:
        return self.kv_used_blocks / self.kv_total_blocks if self.kv_total_blocks else 0.0


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Everything the engine needs, frozen. Built by main.py from config.Settings."""

    model_path: str  # a local folder, or a local .gguf file
    model_name: str  # the id the API reports
    gguf_file: str | None = None  # file name inside model_path when loading GGUF
    device: str = "auto"  # auto | cpu | cuda | cuda:N | tt
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    max_num_seqs: int = 64
    max_model_len: int | None = None  # None: the model's own context length
    max_num_batched_tokens: int = 512  # tokens per step (prefill chunk budget)
    block_size: int = 16
    kv_cache_memory_fraction: float = 0.5  # of the memory free after the model loads
    kv_cache_bytes: int | None = None  # explicit size; overrides the fraction
    kv_cache_dtype: str = "auto"  # auto (the model dtype) | float32 | bfloat16 | float16 | int8
    cache_dir: str | None = None  # converted GGUF models and compiled kernels (needed for both; config's default)
    seed: int = 0
    trust_remote_code: bool = False
    chat_template: str | None = None  # --chat-template: a file or a known name (models/chat_templates); None: own
    model_impl: str = "auto"  # auto | generic | llama: the forward pass (auto: Llama fast path when it applies)
    cpu_kernels: bool = True  # Peregrine's CPU kernels (engine.backends.cpu_kernels, quant_kernels) where they apply
    cpu_isa: str = "auto"  # auto or one of cpu_features.LEVELS: the highest the CPU kernels may use (--cpu-isa)
    weight_format: str = "auto"  # auto | quantized | dense: a GGUF's weights kept quantized in RAM, or dense
    quantize: str | None = None  # "int8": linear weights of a dense model to Q8_0 blocks at load
    prefix_caching: bool = True  # reuse the KV of full blocks whose prefix was computed before (block_manager)
    kv_window_release: bool = True  # sliding-window layers give back the KV pages of blocks behind every window
    speculative: str = "off"  # off | ngram | draft: speculative decoding's proposer (engine/core/speculative.py)
    speculative_tokens: int = 12  # most tokens proposed per sequence and step
    speculative_adaptive: bool = True  # propose as many as pay (Adaptive, StepCost); False: always speculative_tokens
    speculative_ngram_max: int = 4  # prompt lookup matches the last n tokens, n from this ...
    speculative_ngram_min: int = 1  # ... down to this
    # --speculative draft: the draft model's own config, loaded like the model (models/engine_factory.py) and handed
    # to the engine loaded (engine/draft.py); None otherwise
    speculative_draft: EngineConfig | None = None


class EngineError(Exception):
    """Base class for errors the engine reports to its callers."""


class EngineDeadError(EngineError):
    """The engine loop has stopped; no request can be served."""


class PromptTooLongError(EngineError):
    """The prompt (or prompt + max_tokens) does not fit in the model's context. `param` names the engine's input
    at fault, "prompt_token_ids" or "max_tokens"; the app maps it to its wire field."""

    def __init__(self, message: str, *, prompt_tokens: int, max_model_len: int, param: str) -> None:
        super().__init__(message)
        self.prompt_tokens = prompt_tokens
        self.max_model_len = max_model_len
        self.param = param


class InvalidRequestError(EngineError):
    """The request's parameters or prompt are invalid. `param` names the engine's input at fault: a
    `SamplingParams` field, "prompt_token_ids" or "request_id" (the HTTP layer answers 400, naming its wire field)."""

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param
