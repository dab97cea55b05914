"""The models one server serves, each as its own `Settings`: `--model` (given more than once) and `--models-file`.

A models file is YAML (or JSON, which YAML reads too):

    models:
      - model: bundled:smollm2          # what --model takes
        name: smollm2                   # the id the API reports (default: derived from model)
        keep_alive: 10m                 # per model; the server's --model-keep-alive otherwise
        kv_cache_bytes: 256MiB
      - model: /models/qwen2.5-0.5b
        max_model_len: 4096
        chat_template: qwen2.5          # a file or a name the server knows (docs/chat-templates.md)

Each entry may set the keys in `ENTRY_KEYS`; the rest of the server's settings apply to every model. Models
given with `--model` come first, then the file's; the first one is the default (a request without `model`)
and is loaded at start, the others when a request asks for them. Like `config/`, this module imports nothing
of Peregrine's but `config`, and nothing heavy.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

from pydantic import TypeAdapter, ValidationError

from config import ConfigError, Settings, parse_duration

ENTRY_KEYS = {
    "model": "model",
    "name": "served_model_name",
    "served_model_name": "served_model_name",
    "revision": "revision",
    "dtype": "dtype",
    "max_model_len": "max_model_len",
    "max_num_seqs": "max_num_seqs",
    "kv_cache_bytes": "kv_cache_bytes",
    "kv_cache_memory_fraction": "kv_cache_memory_fraction",
    "model_impl": "model_impl",
    "chat_template": "chat_template",  # a file or a known name (docs/chat-templates.md): per model, not per server
}
"""Keys a models-file entry may set (besides `keep_alive`), and the Settings field each one sets."""


@dataclass(frozen=True)
class ModelEntry:
    settings: Settings  # the server's settings with this model's own values
    keep_alive_s: float | None = None  # this model's keep-alive; None: the server's

    @property
    def name(self) -> str:
        return self.settings.model_id


def model_entries(settings: Settings) -> list[ModelEntry]:
    """Every model to serve, in order (the first is the default). Raises ConfigError naming the problem."""
    entries = []
    if "model" in settings.model_fields_set or settings.models_file is None:
        entries.append(ModelEntry(settings))
    entries += [ModelEntry(_override(settings, {"model": m, "served_model_name": None}, "--model"))
                for m in settings.extra_models]  # fmt: skip
    if settings.models_file is not None:
        entries += read_models_file(settings.models_file, settings)
    names = [e.name for e in entries]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ConfigError(f"two models are served as {', '.join(duplicates)}: give them different names "
                          f"({_sources(settings)})")
    if not entries:
        raise ConfigError(f"--models-file {settings.models_file}: no models listed")
    return entries


def _sources(settings: Settings) -> str:
    return "--model" + (f" and --models-file {settings.models_file}" if settings.models_file else "")


def read_models_file(path: Path, settings: Settings) -> list[ModelEntry]:
    import yaml

    where = f"--models-file {path}"
    try:
        data = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"{where}: cannot read it: {exc}") from None
    items = data.get("models") if isinstance(data, dict) else data
    if not isinstance(items, list):
        raise ConfigError(f"{where}: expected a list of models (or {{models: [...]}})")
    return [_entry(item, settings, f"{where}, model {i + 1}") for i, item in enumerate(items)]


def _entry(item: Any, settings: Settings, where: str) -> ModelEntry:
    if isinstance(item, str):
        item = {"model": item}
    if not isinstance(item, dict) or not item.get("model"):
        raise ConfigError(f"{where}: each entry needs 'model' (a Hub id, folder, .gguf or bundled:...)")
    unknown = sorted(set(item) - set(ENTRY_KEYS) - {"keep_alive"})
    if unknown:
        known = ", ".join(sorted({*ENTRY_KEYS, "keep_alive"}))
        raise ConfigError(f"{where}: unknown key(s) {', '.join(unknown)} (known: {known})")
    keep_alive = None
    if "keep_alive" in item:
        try:
            keep_alive = parse_duration(item["keep_alive"])
        except ValueError as exc:
            raise ConfigError(f"{where}: keep_alive {exc}") from None
    update = {"served_model_name": None} | {ENTRY_KEYS[k]: v for k, v in item.items() if k in ENTRY_KEYS}
    return ModelEntry(_override(settings, update, where), keep_alive)


def _override(settings: Settings, update: dict[str, Any], where: str) -> Settings:
    """`settings` with some fields replaced, each value validated as the field's own flag would be."""
    checked = {}
    for name, value in update.items():
        field = Settings.model_fields[name]
        kind = Annotated[field.annotation, *field.metadata] if field.metadata else field.annotation
        adapter = TypeAdapter(kind)  # type: ignore[arg-type]
        try:
            checked[name] = adapter.validate_python(value) if value is not None else None
        except ValidationError as exc:
            message = exc.errors()[0]["msg"].removeprefix("Value error, ")
            raise ConfigError(f"{where}: {name}: {message}, got {value!r}") from None
    return settings.model_copy(update=checked)
