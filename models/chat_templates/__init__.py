"""The chat template a model is served with: its own (the GGUF's `tokenizer.chat_template`, a folder's
tokenizer_config / chat_template.jinja), the one `--chat-template` names (a file, or a family name below), or,
for a model without one, its family's format when its architecture names one. None of these: no template, and
the chat routes answer 400 saying how to pass one (completions need none).

The `.jinja` files are llama.cpp's vendored `models/templates` (MIT; README.md in this folder says which file
each one is), but for `phi4-mini`, written for Peregrine to Phi-4-mini's format. They live in models/ rather than
app/chat/ because the template is settled at load time, when the tokenizer is, and models/ must not import app/."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent

# the names `--chat-template` knows: one file each in this folder
NAMES = ("llama3.1", "llama3.2", "qwen2.5", "qwen3", "gemma", "phi3.5", "mistral-nemo", "mistral-small",
         "granite3.3", "granite4", "deepseek-r1", "hermes3", "gpt-oss", "phi4-mini")  # fmt: skip

# `general.architecture` of a GGUF / `model_type` of a config -> the family's format, for a file without one
BY_ARCHITECTURE = {
    "llama": "llama3.1",
    "qwen2": "qwen2.5",
    "qwen3": "qwen3",
    "gemma3": "gemma",
    "gemma3_text": "gemma",
    "gemma2": "gemma",
    "phi3": "phi3.5",
    "mistral": "mistral-nemo",
    "granite": "granite3.3",
    "gpt-oss": "gpt-oss",
    "gpt_oss": "gpt-oss",
}


class ChatTemplateError(ValueError):
    """`--chat-template` names neither a readable file nor a known template. The message is for the user."""


@dataclass(frozen=True, slots=True)
class ChatTemplate:
    text: str | None  # None: the model has none; chat routes refuse with a 400
    source: str  # what the start log says: "the model's own", "--chat-template qwen3", ...


def named(name: str) -> str:
    """The text of a template the server knows by name."""
    return (HERE / f"{name}.jinja").read_text(encoding="utf-8")


def from_setting(value: str) -> str:
    """`--chat-template`: a known name, else a file path."""
    if value in NAMES:
        return named(value)
    path = Path(value).expanduser()
    if not path.is_file():
        raise ChatTemplateError(
            f"--chat-template {value!r} is neither a file nor one of the known templates ({', '.join(NAMES)})"
        )
    text = path.read_text(encoding="utf-8")
    if not text.strip():
        raise ChatTemplateError(f"--chat-template {value!r}: the file is empty")
    return text


def choose(setting: str | None, own: str | None, architecture: str | None) -> ChatTemplate:
    """The template to serve with: `--chat-template` first, then the model's own, then its family's."""
    if setting:
        return ChatTemplate(from_setting(setting), f"--chat-template {setting}")
    if own:
        return ChatTemplate(own, "the model's own")
    family = BY_ARCHITECTURE.get(architecture or "")
    if family is not None:
        return ChatTemplate(named(family), f"the {architecture} family's format ({family}): the model has none")
    return ChatTemplate(None, "none: the model has no chat template and its architecture names no family format")
