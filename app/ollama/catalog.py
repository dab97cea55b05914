"""What /api/tags, /api/ps and /api/show say about the served models, in the shapes Ollama's clients read.

Facts come from the model's files, read once per file: a GGUF's header (`general.architecture`,
`<arch>.context_length`, `general.file_type`, the tensor shapes) or a folder's config.json and safetensors headers.
`digest` is a sha256 of the file's path, size and modification time: an identity for the served model, not a
hash of its bytes (hashing gigabytes on every listing is not worth it). Several models (serving/registry.py):
every model is listed by /api/tags, the loaded ones by /api/ps with `expires_at` from their keep-alive.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from functools import lru_cache
from pathlib import Path
from typing import Any

from fastapi import Request

from models.preflight import folder_footprint, read_gguf_header

# GGUF general.file_type -> Ollama's quantization_level (llama.cpp's LLAMA_FTYPE_MOSTLY_*)
FILE_TYPES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1", 10: "Q2_K", 11: "Q3_K_S",
              12: "Q3_K_M", 13: "Q3_K_L", 14: "Q4_K_S", 15: "Q4_K_M", 16: "Q5_K_S", 17: "Q5_K_M", 18: "Q6_K",
              32: "BF16"}
TORCH_DTYPES = {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}
FOREVER = datetime(2318, 1, 1, tzinfo=UTC)  # Ollama's expires_at for keep_alive < 0 (a far future)


@dataclass(frozen=True)
class Facts:
    """A model file's description, as Ollama's `details` and `model_info` carry it."""

    path: Path
    format: str  # gguf | safetensors
    family: str  # the architecture: llama, qwen2, ...
    parameters: int
    quantization: str
    context_length: int
    size: int
    modified: datetime
    digest: str
    template: str

    @property
    def parameter_size(self) -> str:
        n = self.parameters
        return f"{n / 1e9:.1f}B" if n >= 1e9 else f"{n / 1e6:.0f}M" if n >= 1e6 else str(n)


@dataclass(frozen=True)
class Served:
    """One served model and where it stands."""

    name: str
    path: Path | None
    engine: Any  # loaded engine, or None
    memory_bytes: int
    expires_in_s: float | None  # None: loaded for good (or not loaded)
    max_model_len: int | None


@lru_cache(maxsize=64)
def facts(path: Path) -> Facts:
    """The facts of a model file or folder, read once (the header only: no weights are loaded)."""
    stat = path.stat()
    identity = f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()
    common = {"path": path, "modified": datetime.fromtimestamp(stat.st_mtime, UTC),
              "digest": hashlib.sha256(identity).hexdigest()}  # fmt: skip
    if path.is_file():
        meta, shapes = read_gguf_header(path)
        arch = str(meta.get("general.architecture", "unknown"))
        return Facts(format="gguf", family=arch, parameters=sum(math.prod(s) for s in shapes.values()),
                     quantization=FILE_TYPES.get(int(meta.get("general.file_type", -1)), "unknown"),  # type: ignore[arg-type]
                     context_length=int(meta.get(f"{arch}.context_length", 0)), size=stat.st_size,  # type: ignore[arg-type]
                     template=str(meta.get("tokenizer.chat_template", "")), **common)  # fmt: skip
    config = json.loads((path / "config.json").read_text())
    footprint = folder_footprint(path)
    size = sum(f.stat().st_size for f in path.iterdir() if f.is_file())
    dtype = str(config.get("torch_dtype") or config.get("dtype") or "float32")
    return Facts(format="safetensors", family=str(config.get("model_type", "unknown")), parameters=footprint.param_count,
                 quantization=TORCH_DTYPES.get(dtype, dtype.upper()), context_length=footprint.context_len or 0,
                 size=size, template=_folder_template(path), **common)  # fmt: skip


def _folder_template(path: Path) -> str:
    for name in ("chat_template.jinja", "tokenizer_config.json"):
        f = path / name
        if f.is_file():
            return f.read_text() if name.endswith(".jinja") else str(json.loads(f.read_text()).get("chat_template") or "")
    return ""


def served(request: Request) -> list[Served]:
    """Every served text generation model: the registry's (several models), else the one engine."""
    registry = getattr(request.app.state, "models", None)
    if registry is not None:
        return [_slot(registry, s) for s in registry.slots.values()]
    engine = getattr(request.app.state, "engine", None)
    if engine is None:
        return []
    cfg = getattr(getattr(engine, "engine", None), "cfg", None)  # AsyncEngine -> LLMEngine -> EngineConfig
    return [Served(engine.model_name, _config_path(cfg), engine, 0, None, engine.max_model_len)]


def _slot(registry: Any, slot: Any) -> Served:
    engine = slot.engine
    max_len = getattr(engine, "max_model_len", None) or slot.spec.max_model_len
    return Served(slot.spec.name, _config_path(slot.spec.config), engine, slot.spec.need_bytes,
                  registry.expires_in(slot), max_len)  # fmt: skip


def _config_path(cfg: Any) -> Path | None:
    if cfg is None or not getattr(cfg, "model_path", None):
        return None
    path = Path(cfg.model_path)
    return path / cfg.gguf_file if cfg.gguf_file else path


def details(model: Served) -> dict[str, Any]:
    f = facts(model.path) if model.path is not None else None
    if f is None:
        return {"parent_model": "", "format": "", "family": "", "families": None, "parameter_size": "",
                "quantization_level": ""}  # fmt: skip
    return {"parent_model": "", "format": f.format, "family": f.family, "families": [f.family],
            "parameter_size": f.parameter_size, "quantization_level": f.quantization}  # fmt: skip


def tag_entry(model: Served) -> dict[str, Any]:
    """One /api/tags entry."""
    f = facts(model.path) if model.path is not None else None
    return {
        "name": model.name, "model": model.name,
        "modified_at": (f.modified if f else datetime.now(UTC)).isoformat().replace("+00:00", "Z"),
        "size": f.size if f else 0, "digest": f.digest if f else "", "details": details(model),
    }  # fmt: skip


def ps_entry(model: Served) -> dict[str, Any]:
    """One /api/ps entry: a loaded model, its memory (the preflight figure, or the file's size) and expiry."""
    f = facts(model.path) if model.path is not None else None
    size = model.memory_bytes or (f.size if f else 0)
    device = str(getattr(model.engine, "device", "cpu"))
    expires = FOREVER if model.expires_in_s is None else datetime.now(UTC) + timedelta(seconds=model.expires_in_s)
    return tag_entry(model) | {
        "size": size, "size_vram": 0 if device.startswith("cpu") else size,
        "expires_at": expires.isoformat().replace("+00:00", "Z"), "context_length": model.max_model_len,
    }  # fmt: skip


def show(model: Served, tokenizer: Any) -> dict[str, Any]:
    """/api/show: the chat template (Jinja: the model's own, which Peregrine renders), parameters, model_info."""
    f = facts(model.path) if model.path is not None else None
    template = (getattr(tokenizer, "chat_template", None) if tokenizer is not None else None) or (f.template if f else "")
    family = f.family if f else "unknown"
    context = model.max_model_len or (f.context_length if f else 0)
    info: dict[str, Any] = {"general.architecture": family, f"{family}.context_length": context,
                            "general.parameter_count": f.parameters if f else 0}  # fmt: skip
    return {
        "modelfile": f"# Served by Peregrine\nFROM {f.path if f else model.name}\n",
        "parameters": f"num_ctx {context}", "template": template if isinstance(template, str) else "",
        "details": details(model), "model_info": info, "capabilities": ["completion", "tools"],
        "modified_at": tag_entry(model)["modified_at"],
    }  # fmt: skip


def embedder_entry(embedder: Any) -> dict[str, Any]:
    """The embedding model, listed by /api/tags as Ollama lists its embedding models (size: its weights in memory)."""
    size = sum(p.numel() * p.element_size() for p in embedder.model.parameters())
    return {"name": embedder.name, "model": embedder.name, "modified_at": datetime.now(UTC).isoformat().replace(
        "+00:00", "Z"), "size": size, "digest": hashlib.sha256(embedder.name.encode()).hexdigest(),
        "details": {"parent_model": "", "format": "safetensors", "family": "bert", "families": ["bert"],
                    "parameter_size": "", "quantization_level": "F32"}}  # fmt: skip
