"""Acquisition in one straight line: settings -> source -> device and dtype -> preflight -> download -> what to load.

`acquire(settings)` is the one call a start makes per model (main.py for one, serving/start.py for each of
several); it hands back a `Prepared`: the local files, the device and dtype chosen, the frozen engine config
and where the embedding model is. Nothing is loaded here. `import_libraries` is the one place the loaders'
heavy libraries are imported, before any loader thread starts.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engine.types import EngineConfig

if TYPE_CHECKING:
    from config import Settings
    from models.hub import DownloadPlan, ModelSource
    from models.memory import ModelFootprint
    from models.preflight import Need

log = logging.getLogger("peregrine")


@dataclass(frozen=True)
class Prepared:
    """What to load: local files, the device and dtype chosen for them, and the engine config that carries them."""

    model_path: Path  # a folder, or a .gguf file
    device: str  # "cpu", "cuda:0", "tt"
    dtype: str  # "float32", "bfloat16", "float16"; "auto" on the CPU, chosen by the loader (models/autotune/dtype.py)
    engine_config: EngineConfig
    embedder_at: tuple[Path, str] | None = None  # the embedding model's folder and served name


class StartError(RuntimeError):
    """A start-up step failed in a way the user can fix; the message says how."""


def acquire(settings: Settings) -> Prepared:
    """Resolve the model source, device and dtype; refuse early if it will not fit; download if needed."""
    from engine.backends.devices import DeviceError, resolve
    from models.gguf_weights import BadFile
    from models.hub import HubError, plan_download

    check_speculative(settings)
    try:
        source = checked_source(settings.model, settings.revision)
        resolved = resolve(settings.device, settings.dtype)  # the one resolution: EngineConfig carries it
        device, dtype = resolved.device, resolved.dtype
        plan = plan_download(source, **_hub_args(settings)) if source.kind == "hub" else None
        log.info("model %s (%s), device %s, dtype %s, KV cache budget %s", settings.model, source.label, device,
                 "auto (decode steps timed once loaded)" if dtype == "auto" else dtype,
                 kv_budget_text(settings))  # fmt: skip
        if not settings.skip_preflight:
            run_preflight(settings, source, plan, device, dtype)
        path = fetch(settings, source, plan)
        cfg = engine_config(settings, path, device, dtype)
        if settings.speculative == "draft":
            cfg = dataclasses.replace(cfg, speculative_draft=draft_config(settings, device, dtype))
    except (DeviceError, HubError, BadFile) as exc:
        raise StartError(str(exc)) from None
    return Prepared(path, device, dtype, cfg, embedder_location(settings))


def checked_source(spec: str, revision: str | None) -> ModelSource:
    """The model source `spec` names; a local GGUF file is checked now (damaged, or an unknown architecture: one
    line at start, not a crash later)."""
    from models.gguf_weights import check
    from models.hub import resolve_source

    source = resolve_source(spec, revision)
    if source.kind == "gguf":
        check(Path(source.path))
    return source


def fetch(settings: Settings, source: ModelSource, plan: DownloadPlan | None) -> Path:
    """The model's local path: downloaded first when `plan` (a Hub download) says so, a downloaded GGUF checked."""
    from models.gguf_weights import check
    from models.hub import download

    path = Path(str(download(plan, **_hub_args(settings, plan=False)) if plan else source.path))
    if plan and path.suffix == ".gguf":
        check(path)
    return path


def check_speculative(settings: Settings) -> None:
    """--speculative draft and --speculative-model go together."""
    if settings.speculative == "draft" and not settings.speculative_model:
        raise StartError("--speculative draft needs a draft model: --speculative-model PATH_OR_ID (a smaller model "
                         "sharing the model's tokenizer)")
    if settings.speculative_model and settings.speculative != "draft":
        raise StartError(f"--speculative-model {settings.speculative_model} is the draft model of --speculative "
                         f"draft; add --speculative draft (now: --speculative {settings.speculative})")


def draft_config(settings: Settings, device: str, dtype: str) -> EngineConfig:
    """The draft model's engine config: its source resolved and downloaded like the model's, on the same device,
    dtype and weight settings (models/engine_factory.py loads it; engine/draft.py runs it)."""
    from models.hub import plan_download

    assert settings.speculative_model is not None
    source = checked_source(settings.speculative_model, None)
    plan = plan_download(source, **_hub_args(settings)) if source.kind == "hub" else None
    path = fetch(settings, source, plan)
    log.info("speculative draft model %s (%s)", settings.speculative_model, source.label)
    cfg = engine_config(settings, path, device, dtype)
    return dataclasses.replace(cfg, model_name=settings.speculative_model, speculative="off", chat_template=None)


def kv_budget_text(settings: Settings) -> str:
    if settings.kv_cache_bytes is not None:
        return f"{settings.kv_cache_bytes.human_readable()} (--kv-cache-bytes)"
    return f"{settings.kv_cache_memory_fraction:.0%} of the memory free after loading"


def _hub_args(settings: Settings, plan: bool = True) -> dict[str, Any]:
    args: dict[str, Any] = {"token": settings.hf_token_value, "download_dir": settings.download_dir}
    return args | ({"trust_remote_code": settings.trust_remote_code} if plan else {})


def run_preflight(settings: Settings, source: ModelSource, plan: DownloadPlan | None, device: str, dtype: str) -> None:
    """Disk for the download (and a GGUF conversion), RAM or VRAM for weights + minimal KV cache."""
    from engine.backends.devices import cuda_index
    from models import preflight
    from models.hub import default_download_dir, plan_download

    download_dir = settings.download_dir or default_download_dir()
    gpu = cuda_index(device)
    resources = preflight.measure_resources([download_dir, settings.cache_dir], gpu)

    def needs_of(source: ModelSource, plan: DownloadPlan | None, kv_cache_bytes: int | None) -> list[Need]:
        footprint, dense, counted = source_footprint(settings, source, plan, device, dtype)
        return preflight.check(
            footprint, resources, dtype=counted, on_cuda=gpu is not None, device_label=device,
            download_dir=str(download_dir), cache_dir=str(settings.cache_dir),
            max_model_len=settings.max_model_len, kv_cache_bytes=kv_cache_bytes,
            packed_copy=preflight.packed_copy_kept(device, settings.cpu_kernels, settings.cpu_isa), dense=dense,
            kv_dtype=settings.kv_cache_dtype,
        )  # fmt: skip

    needs = needs_of(source, plan, settings.kv_cache_bytes)
    if settings.speculative == "draft":
        # the draft is loaded like the model; its KV cache comes out of the same budget: one sequence of it counted
        assert settings.speculative_model is not None
        draft = checked_source(settings.speculative_model, None)
        draft_plan = plan_download(draft, **_hub_args(settings)) if draft.kind == "hub" else None
        needs = preflight.combined(needs, needs_of(draft, draft_plan, None), f"draft {settings.speculative_model}")
    for need in needs:
        log.info("preflight: %s", need.message)
    refusal = preflight.refusal(needs)
    if refusal:
        raise StartError(refusal)


def source_footprint(
    settings: Settings, source: ModelSource, plan: DownloadPlan | None, device: str, dtype: str
) -> tuple[ModelFootprint, tuple[str, ...], str]:
    """What the model needs, from its metadata, the dense dtypes `--weight-format auto` would time beside a GGUF kept
    quantized, and the dtype its weights are counted in (`dtype`, or a BF16 GGUF's own under `--dtype auto`)."""
    from models import preflight
    from models.hub import fetch_config
    from models.loader import gguf_cache_folder, is_converted

    dense: tuple[str, ...] = ()
    try:
        held = held_gguf(Path(source.path), device) if source.kind == "gguf" else None
        if held is not None:  # no quantized tensor (F16, BF16): read as it is into the serving dtype
            footprint = preflight.gguf_footprint(source.path, cached=True)
            dtype = held if dtype == "auto" and held == "bfloat16" else dtype
        elif source.kind == "gguf":
            quantized = settings.weight_format != "dense" and device == "cpu"  # kept as the file holds them
            cached = quantized or is_converted(gguf_cache_folder(source.path, settings.cache_dir))
            footprint = preflight.gguf_footprint(source.path, cached=cached, quantized=quantized)
            if quantized and settings.weight_format == "auto":  # dense copies timed beside it, where they fit
                dense = ("float32", "bfloat16") if dtype == "auto" else (dtype,)
        elif source.kind == "folder":
            footprint = preflight.folder_footprint(source.path)
            _check_architecture(json.loads((Path(source.path) / "config.json").read_text()), source.label)
        else:
            config = fetch_config(plan, **_hub_args(settings, plan=False))
            _check_architecture(config, source.label)
            footprint = preflight.hub_footprint(plan.param_count, plan.files, plan.missing_bytes, config)
    except (OSError, ValueError, KeyError) as exc:
        raise StartError(f"preflight cannot read {source.label}: {exc} (--skip-preflight skips the check)") from None
    return footprint, dense, dtype


def _check_architecture(config: dict[str, Any], label: str) -> None:
    """Refuse, before anything is downloaded, an architecture the paged KV cache cannot serve (the load would)."""
    from engine.model.attention import config_refusal

    message = config_refusal(config)
    if message is not None:
        raise StartError(f"{label}: {message}")


def held_gguf(path: Path, device: str) -> str | None:
    """The dtype a GGUF with no quantized tensor holds (F16, BF16: `gguf_weights.held_dtype`), served as it is on the
    CPU; None for any other file or device."""
    from models import gguf_weights

    return gguf_weights.file_held_dtype(path) if device == "cpu" else None


def counted_dtype(prepared: Prepared) -> str:
    """The dtype a model's weights are counted in: `prepared.dtype`, or a BF16 GGUF's own under `--dtype auto`."""
    if prepared.dtype != "auto" or prepared.model_path.suffix != ".gguf":
        return prepared.dtype
    return "bfloat16" if held_gguf(prepared.model_path, prepared.device) == "bfloat16" else prepared.dtype


def local_footprint(prepared: Prepared, model: str) -> ModelFootprint:
    """What the (now local) model needs, from its headers: a .gguf file (on the CPU its quantized tensors' bytes, as
    they are kept) or a transformers folder."""
    from models import preflight

    path = prepared.model_path
    try:
        if path.suffix == ".gguf":
            quantized = (prepared.device == "cpu" and prepared.engine_config.weight_format != "dense"
                         and held_gguf(path, prepared.device) is None)
            return preflight.gguf_footprint(path, cached=True, quantized=quantized)
        return preflight.folder_footprint(path)
    except (OSError, ValueError, KeyError) as exc:
        raise StartError(f"cannot read the size of {model} at {path}: {exc}") from None


def engine_config(settings: Settings, path: Path, device: str, dtype: str) -> EngineConfig:
    """The frozen engine config for the model at `path` on `device` in `dtype`."""
    is_gguf = path.suffix == ".gguf"
    return EngineConfig(
        model_path=str(path.parent if is_gguf else path),
        model_name=settings.model_id,
        gguf_file=path.name if is_gguf else None,
        device=device,
        dtype=dtype,
        max_num_seqs=settings.max_num_seqs,
        max_model_len=settings.max_model_len,
        max_num_batched_tokens=settings.max_num_batched_tokens,
        block_size=settings.block_size,
        kv_cache_memory_fraction=settings.kv_cache_memory_fraction,
        kv_cache_bytes=settings.kv_cache_bytes,
        kv_cache_dtype=settings.kv_cache_dtype,
        cache_dir=str(settings.cache_dir),
        seed=settings.seed,
        trust_remote_code=settings.trust_remote_code,
        chat_template=settings.chat_template,
        model_impl=settings.model_impl,
        cpu_kernels=settings.cpu_kernels,
        cpu_isa=settings.cpu_isa,
        weight_format=settings.weight_format,
        quantize=None if settings.quantize == "none" else settings.quantize,
        prefix_caching=settings.prefix_caching,
        kv_window_release=settings.kv_window_release,
        speculative=settings.speculative,
        speculative_tokens=settings.speculative_tokens,
        speculative_adaptive=settings.speculative_adaptive,
        speculative_ngram_max=settings.speculative_ngram_max,
        speculative_ngram_min=min(settings.speculative_ngram_min, settings.speculative_ngram_max),
    )


def embedder_location(settings: Settings) -> tuple[Path, str] | None:
    """The embedding model's folder and served name, or None when --embedding-model none."""
    if settings.embedding_model.strip().lower() in ("", "none", "off"):
        return None
    from models.embedder import discoverable_name, resolve_embedding_model

    try:
        path, name = resolve_embedding_model(settings.embedding_model)
    except (ValueError, FileNotFoundError) as exc:
        raise StartError(f"--embedding-model: {exc}") from None
    return path, settings.embedding_served_name or discoverable_name(name)


def import_libraries() -> None:
    """Import what the loaders use, once, in the calling thread, before any loader thread starts. Two threads
    importing transformers at once can find it half-initialised: the several-models start, whose default model
    and embedding model load in two threads, once left its default model unloaded with "ImportError: cannot
    import name 'AutoTokenizer' from 'transformers'" (issue 34)."""
    import gguf  # noqa: F401 - the GGUF readers (models/gguf_weights.py, engine/model/quant.py)
    from transformers import (  # noqa: F401 - transformers' lazy names, resolved here once
        AutoConfig,
        AutoModel,
        AutoModelForCausalLM,
        AutoTokenizer,
        GenerationConfig,
        PreTrainedModel,
        PreTrainedTokenizerFast,
    )

    import engine.async_engine  # noqa: F401 - the engine, its model runner and kernels' Python side
    import engine.llm_engine  # noqa: F401
    import models.embedder  # noqa: F401
    import models.gguf_weights  # noqa: F401
    import models.loader  # noqa: F401
