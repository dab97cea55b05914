"""/api/pull and /api/delete over Peregrine's own download path (models/hub.py) and preflight (models/preflight.py).

`pull` takes what `--model` takes: a Hugging Face Hub id (`org/name`, downloaded into the download dir, the
Hugging Face cache layout, one file at a time so the stream can say which), a local folder or .gguf file (checked,
nothing fetched), or `bundled:NAME`. Before any byte is fetched the preflight asks whether the model would fit
this machine (disk for the download, RAM for weights and a minimal KV cache); a refusal is the stream's error line.
A pulled model is on disk, ready for `--model` or a models file: this server does not start serving it by itself.

`delete` removes only what Peregrine downloaded: a Hub id's folder in the download dir. A bundled model, a local
folder or file, and a model this server is serving are refused.
"""

from __future__ import annotations

import asyncio
import hashlib
import shutil
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path
from typing import Any

from app.errors import BadRequestError, NotFoundError
from models import preflight
from models.hub import (
    DownloadPlan,
    HubError,
    ModelSource,
    default_download_dir,
    download,
    fetch_config,
    plan_download,
    resolve_source,
)


def hub_name(model: str) -> str:
    """Ollama's clients may add the default tag; Hub ids and paths have none."""
    return model.removesuffix(":latest")


def source_of(model: str) -> ModelSource:
    try:
        return resolve_source(hub_name(model))
    except HubError as exc:
        raise NotFoundError(str(exc), param="model") from None


async def pull_events(model: str, settings: Any, endpoint: str | None = None) -> AsyncIterator[dict[str, Any]]:
    """Ollama's progress lines: `pulling manifest`, one `pulling <file>` per file with `total` and `completed`,
    then `success`. Errors (the Hub's, the preflight's) are raised; the route turns them into an error line.
    `endpoint`: another Hub than huggingface.co's (tests use a local stand-in)."""
    yield {"status": "pulling manifest"}
    source = source_of(model)
    if source.kind != "hub":
        await asyncio.to_thread(_check_local, source, settings)
        yield {"status": f"using local model {source.path}"}
        yield {"status": "success"}
        return
    args = _hub_args(settings) | {"endpoint": endpoint}
    plan = await _to_thread(plan_download, source, **args)
    await _to_thread(_preflight, plan, settings, args)
    for name, size in sorted(plan.files.items()):
        progress = {"status": f"pulling {name}", "digest": _digest(plan, name), "total": size}
        yield progress | {"completed": 0 if name in plan.missing else size}
        if name in plan.missing:
            one = replace(plan, files={name: size}, missing={name: size})
            await _to_thread(download, one, **args)
            yield progress | {"completed": size}
    await _to_thread(download, replace(plan, missing={}), **args)  # every file there: the snapshot is whole
    yield {"status": "success"}


async def _to_thread(fn: Any, *args: Any, **kwargs: Any) -> Any:
    try:
        return await asyncio.to_thread(fn, *args, **kwargs)
    except HubError as exc:
        raise BadRequestError(f"pull: {exc}", param="model") from None


def _hub_args(settings: Any) -> dict[str, Any]:
    return {"token": getattr(settings, "hf_token_value", None), "download_dir": getattr(settings, "download_dir", None)}


def _digest(plan: DownloadPlan, name: str) -> str:
    """An id for one file of the pull (Ollama shows a layer's digest): the file's name at the planned commit."""
    return "sha256:" + hashlib.sha256(f"{plan.repo_id}@{plan.commit or plan.revision}/{name}".encode()).hexdigest()


def _preflight(plan: DownloadPlan, settings: Any, args: dict[str, Any]) -> None:
    """The start-up preflight's arithmetic (main.run_preflight) for a Hub model: refuse what cannot fit."""
    download_dir = Path(getattr(settings, "download_dir", None) or default_download_dir())
    cache_dir = Path(getattr(settings, "cache_dir", None) or download_dir)
    config = fetch_config(plan, **args)
    footprint = preflight.hub_footprint(plan.param_count, plan.files, plan.missing_bytes, config)
    _refuse(footprint, settings, download_dir, cache_dir)


def _check_local(source: ModelSource, settings: Any) -> None:
    assert source.path is not None  # folder and gguf sources always have one
    try:
        if source.kind == "gguf":
            footprint = preflight.gguf_footprint(source.path, cached=True, quantized=True)
        else:
            footprint = preflight.folder_footprint(source.path)
    except (OSError, ValueError, KeyError) as exc:
        raise BadRequestError(f"pull: cannot read the model at {source.path}: {exc}", param="model") from None
    cache_dir = Path(getattr(settings, "cache_dir", None) or source.path.parent)
    _refuse(footprint, settings, cache_dir, cache_dir)


def _refuse(footprint: preflight.ModelFootprint, settings: Any, download_dir: Path, cache_dir: Path) -> None:
    dtype = str(getattr(settings, "dtype", "auto"))
    resources = preflight.measure_resources([download_dir, cache_dir])
    needs = preflight.check(footprint, resources, dtype=dtype, on_cuda=False, download_dir=str(download_dir),
                            cache_dir=str(cache_dir), max_model_len=getattr(settings, "max_model_len", None),
                            kv_cache_bytes=getattr(settings, "kv_cache_bytes", None))  # fmt: skip
    refusal = preflight.refusal(needs)
    if refusal:
        raise BadRequestError(f"pull: {refusal}", param="model", code="preflight_refused")


async def delete(model: str, settings: Any, served: list[str]) -> None:
    """Remove a Hub model Peregrine downloaded. 404 when it was never downloaded; 400 for anything else."""
    name = hub_name(model)
    if model in served or name in served:
        raise BadRequestError(f"model '{model}' is being served; it cannot be deleted while the server runs it.",
                              param="model")
    if name.startswith("bundled:"):
        raise BadRequestError(f"model '{model}' is bundled with Peregrine's packages; it is never deleted.",
                              param="model")
    source = source_of(name)
    if source.kind != "hub" or source.repo_id is None:
        raise BadRequestError(f"'{model}' is a local {source.kind}: only models Peregrine downloaded are deleted.",
                              param="model")
    try:
        folder = _repo_folder(source.repo_id, settings)
    except ValueError as exc:  # huggingface_hub's HFValidationError: not a Hub repo id at all
        raise BadRequestError(f"'{model}' is not a Hub model id: {exc}", param="model") from None
    if not folder.is_dir():
        raise NotFoundError(f"model '{model}' not found", param="model")
    await asyncio.to_thread(shutil.rmtree, folder)


def _repo_folder(repo_id: str, settings: Any) -> Path:
    from huggingface_hub.file_download import repo_folder_name

    root = Path(getattr(settings, "download_dir", None) or default_download_dir())
    return root / repo_folder_name(repo_id=repo_id, repo_type="model")
