"""The sources Settings reads beside its own fields: the command line (with a repeated `--model`), the conventional
environment variables (HF_TOKEN, RAY_ADDRESS), Ollama-style durations. Imports nothing of ours
(config/settings.py and config/cli.py import this module)."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from pydantic.fields import FieldInfo
from pydantic_settings import PydanticBaseSettingsSource

ENV_PREFIX = "PEREGRINE_"
DEFAULT_CACHE_DIR = Path("~/.cache/peregrine")  # the one default; callers of the engine pass it on


def tool_cache_dir() -> Path:
    """The cache dir for code that runs without Settings (setup.sh's kernel build, scripts, tests):
    PEREGRINE_CACHE_DIR as Settings reads it, else DEFAULT_CACHE_DIR. The server passes Settings.cache_dir."""
    return Path(os.environ.get(f"{ENV_PREFIX}CACHE_DIR") or DEFAULT_CACHE_DIR).expanduser()
ENV_FILE = ".env"
PROG = "main.py"


# Settings that also answer to the variable their ecosystem uses, below PEREGRINE_<NAME> in priority.
CONVENTIONAL_ENV = {"hf_token": "HF_TOKEN", "ray_address": "RAY_ADDRESS"}


class ConventionalEnvSource(PydanticBaseSettingsSource):
    """HF_TOKEN and RAY_ADDRESS from the environment, then from .env."""

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        return None, field_name, False

    def __call__(self) -> dict[str, Any]:
        found = {}
        for field_name, var in CONVENTIONAL_ENV.items():
            value = os.environ.get(var) or _dotenv_value(ENV_FILE, var)
            if value:
                found[field_name] = value
        return found


def _dotenv_value(path: str, key: str) -> str | None:
    if not os.path.isfile(path):
        return None
    from dotenv import dotenv_values

    return dotenv_values(path).get(key)


class ConfigError(Exception):
    """A setting has a bad value. The message names the setting and is meant for the user as is."""


def repeated_model_flags(args: list[str]) -> list[str]:
    """`--model a --model b`: the first stays --model, the others become --extra-models (argparse would keep
    only the last)."""
    out: list[str] = []
    seen = False
    i = 0
    while i < len(args):
        arg = args[i]
        inline = arg.startswith("--model=")
        if (arg == "--model" and i + 1 < len(args)) or inline:
            value = arg.partition("=")[2] if inline else args[i + 1]
            out += ["--extra-models" if seen else "--model", value]
            seen = True
            i += 1 if inline else 2
            continue
        out.append(arg)
        i += 1
    return out


_DURATION_PART = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h)")
_DURATION_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}


def parse_duration(value: object) -> float:
    """Ollama's keep_alive: seconds as a number, or a Go-style duration ("30s", "5m", "1h30m"); any negative
    value means forever (returned as -1.0). Raises ValueError for anything else."""
    if isinstance(value, bool) or value is None:
        raise ValueError("must be a duration such as 30s, 5m, 1h, or a number of seconds")
    if isinstance(value, int | float):
        return float(value) if value >= 0 else -1.0
    text = str(value).strip().lower()
    try:
        return parse_duration(float(text))
    except ValueError:
        pass
    body = text.lstrip("-+")
    parts = _DURATION_PART.findall(body)
    if not parts or "".join(n + u for n, u in parts) != body:
        raise ValueError("must be a duration such as 30s, 5m, 1h, or a number of seconds")
    seconds = sum(float(n) * _DURATION_UNITS[u] for n, u in parts)
    return -1.0 if text.startswith("-") else seconds
