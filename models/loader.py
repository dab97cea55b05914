"""Load a causal LM and its tokenizer onto the chosen device, in the chosen dtype, ready for inference.

Two sources (from `EngineConfig`):
  - a local folder with config.json, tokenizer files and safetensors (or .bin) weights: loaded directly;
  - a .gguf file (`model_path` + `gguf_file`): converted ONCE by transformers (tokenizer conversion and
    dequantization take ~30 s for SmolLM2-135M on 2 cores) and the result is cached in `cfg.cache_dir`
    as an ordinary folder, so later starts load it in about a second and need no network.

What is cached: the weights dequantized to dense float32 safetensors (the faithful copy: a Q4_1 block
dequantizes exactly into float32, while bfloat16 would round the result), plus the tokenizer, its chat
template, config.json and generation_config.json. The folder is named after the file and a hash of its
size and first and last 4 MiB, so a changed file gets a new conversion and a reinstalled identical one
does not. Serving in bfloat16 casts from that copy at load time.

On the CPU a GGUF is read as it is instead (models/gguf_weights.py), nothing written but a few MB of metadata: its
quantized tensors kept quantized (`load_quantized_gguf`), or, for a file with no quantized tensor (F16, BF16),
every tensor read straight into the serving dtype (`load_dense_gguf`).
"""

from __future__ import annotations

import gc
import json
import logging
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engine.backends.devices import backend_for, placement
from engine.backends.huge_pages import release_freed_memory
from engine.model.attention import UnsupportedModel, check_supported
from engine.types import EngineConfig
from models import chat_templates, memory, preflight
from models.autotune import dtype as dtype_probe
from models.autotune import remembered
from models.fingerprint import gguf_fingerprint

log = logging.getLogger(__name__)

GGUF_CACHE_FORMAT = 1  # bump when the cached layout changes; old folders are then ignored


@dataclass
class LoadedModel:
    model: torch.nn.Module
    tokenizer: Any  # a transformers PreTrainedTokenizerBase
    device: torch.device
    dtype: torch.dtype
    max_model_len: int


class LoadError(RuntimeError):
    """The model cannot be loaded as configured. The message is for the user."""


def load_model(cfg: EngineConfig) -> LoadedModel:
    """Load tokenizer and weights on the configured device (a GGUF kept quantized, or converted once to a dense
    cache); eval, no grad. The one place the dtype is decided: `--dtype auto` on the CPU loads float32 and times
    decode steps in each candidate (models/autotune/dtype.py); the returned `dtype` is the one served."""
    device, dtype = placement(cfg.device, cfg.dtype)
    backend = backend_for(cfg, device)  # every device decision (placement, kernels) is the backend's
    start, asked = time.perf_counter(), dtype
    held = held_gguf_dtype(cfg, device)
    if held is not None:
        loaded = load_dense_gguf(cfg, device, dtype, held)
    else:
        loaded = load_quantized_gguf(cfg, device, dtype) if serves_quantized_gguf(cfg, device) else None
    if loaded is not None:
        (model, tokenizer, dtype, folder), loaded = loaded, None  # the model only: a dense one may replace it
        backend.prepare_weights(model)  # the quantized-weight kernels the config allows (none: --cpu-kernels off)
        if held is not None and cfg.quantize == "int8":
            quantize_int8(model, device, cfg)
        if cfg.weight_format == "auto" and held is None:  # `--dtype auto` gives float32 and bfloat16 candidates
            model, dtype = fastest_format(model, tokenizer, cfg, device, dtype, auto_dtype=asked is None)
    else:
        folder = model_folder(cfg)
        tokenizer = load_tokenizer(folder, cfg.trust_remote_code, cfg.chat_template)
        if dtype is None:
            model, dtype = load_fastest(folder, tokenizer, cfg, device)
        else:
            model = load_weights(folder, dtype, device, cfg)
        if cfg.quantize == "int8":
            quantize_int8(model, device, cfg)
    log_resident(model)
    max_len = context_length(model.config, cfg.max_model_len)
    log.info(
        "loaded %s from %s on %s in %s in %.1f s (max_model_len %d)",
        cfg.model_name,
        folder,
        device,
        str(dtype).removeprefix("torch."),
        time.perf_counter() - start,
        max_len,
    )
    return LoadedModel(model, tokenizer, device, dtype, max_len)


def load_fastest(folder: Path, tokenizer: Any, cfg: EngineConfig, device: torch.device) -> tuple[Any, torch.dtype]:
    """`--dtype auto` on the CPU: float32 and bfloat16 timed on real decode steps when the probe's peak fits in the
    free RAM (the preflight's arithmetic), else bfloat16 without a probe."""
    dtypes, why = cpu_dtypes(preflight.folder_footprint(folder), cfg, device)
    if len(dtypes) == 1:
        log.info("dtype auto: bfloat16 (%s)", why)
        return load_weights(folder, torch.bfloat16, device, cfg), torch.bfloat16
    model = load_weights(folder, torch.float32, device, cfg)
    chosen = dtype_probe.choose(model, tokenizer, cfg, device, context_length(model.config, cfg.max_model_len))
    del model
    gc.collect()  # the other dtype's copy and the probe's engines: the KV cache is sized from the RAM free after this
    release_freed_memory()
    return chosen


def cpu_dtypes(fp: Any, cfg: EngineConfig, device: torch.device) -> tuple[tuple[str, ...], str]:
    """The dtypes `--dtype auto` times for a model of footprint `fp` in the RAM free now (`memory.auto_cpu_dtypes`)."""
    return memory.auto_cpu_dtypes(
        fp, preflight.measure_resources([]).ram_free, max_model_len=cfg.max_model_len,
        kv_cache_bytes=cfg.kv_cache_bytes, kv_dtype=cfg.kv_cache_dtype,
        packed_copy=preflight.packed_copy_kept(str(device), cfg.cpu_kernels, cfg.cpu_isa),
    )  # fmt: skip


def fastest_format(model: Any, tokenizer: Any, cfg: EngineConfig, device: torch.device, dtype: torch.dtype,
                   auto_dtype: bool) -> tuple[Any, torch.dtype]:
    """`--weight-format auto`, a GGUF loaded quantized: dense copies built in memory (float32 and bfloat16 with
    `--dtype auto`, else the dtype asked for) and timed against it (models/autotune/weight_format.py), those whose
    probe peak fits in the free RAM (the preflight's arithmetic); with none, the quantized model as it is."""
    from models.autotune import weight_format as weight_format_probe

    candidates = ("float32", "bfloat16") if auto_dtype else (str(dtype).removeprefix("torch."),)
    path = Path(cfg.model_path) / str(cfg.gguf_file)
    dense, why = memory.auto_weight_formats(
        preflight.gguf_footprint(path, cached=True, quantized=True), preflight.measure_resources([]).ram_free,
        candidates, max_model_len=cfg.max_model_len, kv_cache_bytes=cfg.kv_cache_bytes,
        packed_copy=preflight.packed_copy_kept(str(device), cfg.cpu_kernels, cfg.cpu_isa), kv_dtype=cfg.kv_cache_dtype,
    )  # fmt: skip
    if not dense:
        log.info("weight format auto: quantized (%s)", why)
        return model, dtype
    if why:
        log.info("weight format auto: %s", why)
    digest = remembered.key(file=gguf_fingerprint(path), candidates=dense, dtype=str(dtype),
                            rows=dtype_probe.ProbePlan.for_config(cfg).rows,
                            cpu_kernels=cfg.cpu_kernels, cpu_isa=cfg.cpu_isa, kv=cfg.kv_cache_dtype)
    cache = Path(cfg.cache_dir) if cfg.cache_dir else None  # where nothing is cached, nothing is remembered
    kept = remembered.recall(cache, "weight-format", digest) if cache else None
    if kept is not None and kept.choice in weight_format_probe.names(dense):
        log.info("weight format auto: %s, as timed on this CPU for this file at %s (%s; delete %s to time again)",
                 kept.choice, kept.decided_at, kept.reason, kept.path)
        return weight_format_probe.apply(model, kept.choice, dtype)
    *chosen, name, reason = weight_format_probe.choose(model, tokenizer, cfg, device, dtype,
                                                      context_length(model.config, cfg.max_model_len),
                                                      [getattr(torch, d) for d in dense])  # fmt: skip
    if cache:
        remembered.remember(cache, "weight-format", digest, name, reason)
    del model
    gc.collect()  # the candidates not kept and the probe's engines
    release_freed_memory()
    return chosen[0], chosen[1]


def serves_quantized_gguf(cfg: EngineConfig, device: torch.device) -> bool:
    """`--weight-format`: quantized (GGUF files only, CPU only), dense, or auto (a GGUF on CPU loads quantized, then
    `fastest_format` may serve a dense copy)."""
    if cfg.weight_format == "dense" or cfg.gguf_file is None:
        if cfg.weight_format == "quantized" and cfg.gguf_file is None and cfg.quantize is None:
            raise LoadError("--weight-format quantized needs a .gguf model (or --quantize int8 for safetensors)")
        return False
    if not backend_for(cfg, device).serves_quantized:
        if cfg.weight_format == "quantized":
            raise LoadError(f"--weight-format quantized runs on the CPU only, not on {device}")
        return False
    return True


def load_quantized_gguf(
    cfg: EngineConfig, device: torch.device, dtype: torch.dtype | None
) -> tuple[Any, Any, torch.dtype, Path] | None:
    """The GGUF's weights kept quantized (models/gguf_weights.py), or None to fall back to the dense conversion
    (`--weight-format auto` and a file the kernels do not take: logged)."""

    path = Path(cfg.model_path) / cfg.gguf_file
    if not path.is_file():
        raise LoadError(f"GGUF file not found: {path}")
    if dtype is None:
        log.info("dtype auto: float32 for activations (quantized weights: the kernels compute in float32)")
        dtype = torch.float32
    read = read_gguf(cfg, path, dtype, "quantized")
    if read is None:
        return None
    model, tokenizer, folder = read
    log.info("GGUF %s: weights kept quantized (%s)", path.name, quant_summary(model))
    return model, tokenizer, dtype, folder


def read_gguf(cfg: EngineConfig, path: Path, dtype: torch.dtype, served: str) -> tuple[Any, Any, Path] | None:
    """The GGUF read as it is (models/gguf_weights.py: checked, its metadata cached, its tokenizer, its tensors in
    `dtype`): (model, tokenizer, metadata folder). A damaged file is a LoadError; one the reader does not take is one
    too under `--weight-format quantized` (`served`: how it would have been served, for the message), else None
    after a warning (the dense conversion serves it)."""
    from models import gguf_weights

    if not cfg.cache_dir:
        raise LoadError("a GGUF model needs EngineConfig.cache_dir for its metadata (config.DEFAULT_CACHE_DIR)")
    try:
        gguf_weights.check(path)
        folder = gguf_weights.metadata_folder(path, Path(cfg.cache_dir).expanduser())
        tokenizer = load_tokenizer(folder, cfg.trust_remote_code, cfg.chat_template)
        return gguf_weights.load(path, folder, dtype, cfg.trust_remote_code, cfg.max_model_len), tokenizer, folder
    except gguf_weights.BadFile as exc:
        raise LoadError(str(exc)) from None
    except gguf_weights.Unsupported as exc:
        if cfg.weight_format == "quantized":
            raise LoadError(f"{path.name} cannot be served {served}: {exc}") from exc
        log.warning("GGUF %s: %s; converting to dense float32 instead (--weight-format %s)", path.name, exc,
                    cfg.weight_format)
        return None


def held_gguf_dtype(cfg: EngineConfig, device: torch.device) -> str | None:
    """The dtype a GGUF with no quantized tensor holds (`gguf_weights.held_dtype`: an F16 or BF16 file), which the
    CPU serves as it is whatever `--weight-format` says; None for any other model or device."""
    from models import gguf_weights

    path = Path(cfg.model_path) / str(cfg.gguf_file)
    if cfg.gguf_file is None or not path.is_file() or not backend_for(cfg, device).serves_quantized:
        return None
    try:
        return gguf_weights.file_held_dtype(path)
    except (OSError, ValueError):
        return None  # damaged: the quantized load's check says how


def load_dense_gguf(
    cfg: EngineConfig, device: torch.device, dtype: torch.dtype | None, held: str
) -> tuple[Any, Any, torch.dtype, Path] | None:
    """A GGUF with no quantized tensor (`held`: its type), each tensor read from the file into the serving dtype,
    nothing converted to disk. `--dtype auto`: a BF16 file in bfloat16, its own type; an F16 or F32 file timed in
    float32 and bfloat16 as a dense folder is (`load_fastest`'s rule and probe). None: an architecture the reader
    does not take (the conversion serves it)."""
    from models import gguf_weights

    path = Path(cfg.model_path) / str(cfg.gguf_file)
    probe = False
    if dtype is None and cfg.quantize == "int8":  # quantized next: activations in float32, as for quantized files
        log.info("dtype auto: float32 for activations (--quantize int8: the kernels compute in float32)")
        dtype = torch.float32
    elif dtype is None and held == "bfloat16":
        log.info("dtype auto: bfloat16, the file's own type")
        dtype = torch.bfloat16
    elif dtype is None:
        dtypes, why = cpu_dtypes(preflight.gguf_footprint(path, cached=True), cfg, device)
        probe, dtype = len(dtypes) > 1, torch.float32 if len(dtypes) > 1 else torch.bfloat16
        if why:
            log.info("dtype auto: bfloat16 (%s)", why)
    read = read_gguf(cfg, path, dtype, "as it is")
    if read is None:
        return None
    model, tokenizer, folder = read
    log.info("GGUF %s: %s weights read as the file holds them into %s (nothing converted to disk)", path.name,
             gguf_weights.HELD_NAMES[held], str(dtype).removeprefix("torch."))
    if probe:
        model, dtype = dtype_probe.choose(model, tokenizer, cfg, device, context_length(model.config, cfg.max_model_len))
        gc.collect()  # the other dtype's copy and the probe's engines
        release_freed_memory()
    return model, tokenizer, dtype, folder


def quantize_int8(model: Any, device: torch.device, cfg: EngineConfig) -> None:
    """`--quantize int8`: every Linear of the decoder layers and the LM head to Q8_0 blocks, the same kernels as
    GGUF weights (CPU only; a tied LM head shares the embedding's one quantized copy)."""
    from engine.model.quant import QuantEmbedding, QuantLinear, quantize_q8_0

    backend = backend_for(cfg, device)
    if not backend.serves_quantized:
        raise LoadError(f"--quantize int8 runs on the CPU only, not on {device}")
    names = [n for n, m in model.named_modules() if type(m) is torch.nn.Linear and m.in_features % 32 == 0]
    embed = model.get_input_embeddings()
    tied = getattr(model.lm_head, "weight", None) is getattr(embed, "weight", None)
    for name in names:
        parent, _, attr = name.rpartition(".")
        owner = model.get_submodule(parent) if parent else model
        linear = getattr(owner, attr)
        if tied and name == "lm_head":
            continue
        setattr(owner, attr, QuantLinear(quantize_q8_0(linear.weight).repack(), linear.bias))
    if tied and embed.embedding_dim % 32 == 0:
        weight = quantize_q8_0(embed.weight).repack()
        model.set_input_embeddings(QuantEmbedding(weight, embed.weight.dtype))
        model.lm_head = QuantLinear(weight)
    backend.prepare_weights(model)
    gc.collect()
    release_freed_memory()
    log.info("--quantize int8: linear weights quantized to Q8_0 (%s)", quant_summary(model))


def quant_summary(model: Any) -> str:
    from collections import Counter

    from engine.model.quant import QuantEmbedding, QuantLinear

    kinds = Counter(m.qweight.type_name for m in model.modules() if isinstance(m, (QuantLinear, QuantEmbedding)))
    return ", ".join(f"{n} {kind}" for kind, n in sorted(kinds.items()))


def log_resident(model: Any) -> None:
    from engine.model.quant import resident_bytes

    log.info("weights resident: %s", memory.fmt_bytes(resident_bytes(model)))


def model_folder(cfg: EngineConfig) -> Path:
    """The folder transformers loads: `model_path` itself, or the cached conversion of its GGUF file."""
    path = Path(cfg.model_path)
    if cfg.gguf_file is None:
        if not (path / "config.json").is_file():
            raise LoadError(f"{path} has no config.json: not a transformers model folder")
        return path
    if not cfg.cache_dir:
        raise LoadError("a GGUF model needs EngineConfig.cache_dir for its conversion (config.DEFAULT_CACHE_DIR)")
    return ensure_gguf_converted(path / cfg.gguf_file, Path(cfg.cache_dir).expanduser())


def load_tokenizer(folder: Path, trust_remote_code: bool = False, chat_template: str | None = None) -> Any:
    """The model's tokenizer, with the chat template it is served with (models/chat_templates: `--chat-template`,
    else its own, else its family's; None leaves the chat routes answering 400)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=trust_remote_code)
    drop_build_lists(tokenizer)
    try:
        chosen = chat_templates.choose(chat_template, tokenizer.chat_template, model_type(folder))
    except chat_templates.ChatTemplateError as exc:
        raise LoadError(str(exc)) from None
    tokenizer.chat_template = chosen.text
    if chosen.text is None:
        log.warning("%s has no chat template and its architecture names no family format: chat requests answer "
                    "400 until the server is started with --chat-template FILE|NAME (completions work)", folder)
    else:
        log.info("chat template: %s", chosen.source)
    return tokenizer


# transformers' tokenizers of these classes build their Rust BPE from Python copies of the vocabulary and merges in
# `__init__` and keep them (`_vocab`, `_merges`) though nothing reads them after: 63 MiB resident for Qwen2/3's
# 151,936 tokens, 95 MiB for Gemma 3's 262,144 (their GGUFs' cached tokenizers, after gc and malloc_trim).
_BUILD_LISTS_UNUSED = ("GPT2Tokenizer", "GemmaTokenizer", "LlamaTokenizer", "Qwen2Tokenizer")


def drop_build_lists(tokenizer: Any) -> None:
    """Frees the Python vocabulary and merges a tokenizer of `_BUILD_LISTS_UNUSED` built its Rust tokenizer from
    (encoding, decoding, `get_vocab` and saving read the Rust one)."""
    if type(tokenizer).__name__ in _BUILD_LISTS_UNUSED and getattr(tokenizer, "_tokenizer", None) is not None:
        for name in ("_vocab", "_merges"):
            built_from = getattr(tokenizer, name, None)
            if isinstance(built_from, (dict, list)):
                setattr(tokenizer, name, type(built_from)())


def model_type(folder: Path) -> str | None:
    """`model_type` of the folder's config.json (a GGUF's `general.architecture`, as its conversion writes it)."""
    try:
        return json.loads((folder / "config.json").read_text(encoding="utf-8")).get("model_type")
    except (OSError, ValueError):
        return None


def load_weights(folder: Path, dtype: torch.dtype, device: torch.device, cfg: EngineConfig) -> Any:
    """AutoModelForCausalLM in eval mode with gradients off, placed as the device's backend says (straight onto a
    CUDA device while loading)."""
    from transformers import AutoModelForCausalLM

    backend = backend_for(cfg, device)
    try:
        model = AutoModelForCausalLM.from_pretrained(
            folder, dtype=dtype, trust_remote_code=cfg.trust_remote_code, **backend.load_kwargs()
        )
    except (ValueError, OSError) as exc:
        raise LoadError(f"transformers cannot load {folder} as a causal LM: {exc}") from exc
    try:
        check_supported(model)
    except UnsupportedModel as exc:
        raise LoadError(str(exc)) from None
    model = backend.place(model)
    model.eval()
    model.requires_grad_(False)
    return model


def context_length(config: Any, requested: int | None) -> int:
    """The model's context (from its config), or the requested one if it is not longer."""
    text_config = getattr(config, "text_config", None) or config
    own = next((int(v) for a in preflight.CONTEXT_KEYS if (v := getattr(text_config, a, None))), None)
    if requested is None:
        if own is None:
            raise LoadError("the model's config gives no context length: pass --max-model-len")
        return own
    if own is not None and requested > own:
        raise LoadError(f"--max-model-len {requested} is longer than the model's context ({own} tokens)")
    return requested


# --- GGUF conversion cache ----------------------------------------------------------------------------


def gguf_cache_folder(gguf_path: Path, cache_dir: Path) -> Path:
    return cache_dir / "gguf" / f"{gguf_path.stem}-{gguf_fingerprint(gguf_path)}"


def is_converted(folder: Path) -> bool:
    marker = folder / "peregrine.json"
    if not marker.is_file():
        return False
    try:
        return json.loads(marker.read_text()).get("format") == GGUF_CACHE_FORMAT
    except (OSError, ValueError):
        return False


def ensure_gguf_converted(gguf_path: Path, cache_dir: Path) -> Path:
    """The cached dense folder for `gguf_path`, converting first if needed (atomic: a half-written
    conversion is never used, and two processes converting at once both end with one good folder)."""
    if not gguf_path.is_file():
        raise LoadError(f"GGUF file not found: {gguf_path}")
    target = gguf_cache_folder(gguf_path, cache_dir)
    if is_converted(target):
        log.info("GGUF %s: using the cached conversion %s", gguf_path.name, target)
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    log.info(
        "GGUF %s: converting once to float32 safetensors in %s (about 30 s per 100M parameters)",
        gguf_path.name,
        target,
    )
    start = time.perf_counter()
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        convert_gguf(gguf_path, tmp)
        _publish(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log.info("GGUF %s: converted in %.1f s", gguf_path.name, time.perf_counter() - start)
    return target


def convert_gguf(gguf_path: Path, out: Path) -> None:
    """Dequantize with transformers (tokenizer and chat template included) and save as a plain folder."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = gguf_path.parent, gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    # The weights are dense now; drop the GGUF quantization record so the folder loads as a plain model.
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    marker = {
        "format": GGUF_CACHE_FORMAT,
        "source": str(gguf_path),
        "dtype": "float32",
        "fingerprint": gguf_fingerprint(gguf_path),
    }
    (out / "peregrine.json").write_text(json.dumps(marker, indent=2) + "\n")


def _publish(tmp: Path, target: Path) -> None:
    if target.exists() and not is_converted(target):
        shutil.rmtree(target, ignore_errors=True)  # a stale or foreign folder: replace it
    try:
        os.rename(tmp, target)
    except OSError:
        if not is_converted(target):  # someone else published first: theirs is as good as ours
            raise
