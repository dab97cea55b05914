"""Reading Settings from their sources: the command line (with a repeated `--model`), the conventional
environment variables (HF_TOKEN, RAY_ADDRESS), Ollama-style durations, and a bad value as one clean line.

Nothing here imports `config.Settings` at module level (`config/__init__.py` imports this module).
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError
from pydantic.fields import FieldInfo
from pydantic_settings import PydanticBaseSettingsSource, SettingsError

if TYPE_CHECKING:
    from config import Settings

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


_SECRET_FIELDS = frozenset({"hf_token", "api_keys", "jwt_secret"})


class ConfigError(Exception):
    """A setting has a bad value. The message names the setting and is meant for the user as is."""


def load_settings(argv: Sequence[str] | None = None) -> Settings:
    """Build Settings from flags (argv; None means sys.argv[1:]), env and .env. Raises ConfigError."""
    from config import Settings

    args = repeated_model_flags(list(sys.argv[1:] if argv is None else argv))
    try:
        return Settings(_cli_parse_args=args)
    except ValidationError as exc:
        raise ConfigError(_describe(exc)) from None
    except SettingsError as exc:
        raise ConfigError(f"bad settings: {exc}") from None


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


def _describe(exc: ValidationError) -> str:
    """One line per bad setting, naming the flag and the environment variable, e.g.
    `--port (PEREGRINE_PORT): Input should be less than or equal to 65535, got 70000`."""
    lines = []
    for err in exc.errors():
        name = str(err["loc"][0]) if err["loc"] else ""
        message = err["msg"].removeprefix("Value error, ")
        if name:
            flag = "--" + name.replace("_", "-")
            shown = "a secret" if name in _SECRET_FIELDS else repr(err.get("input"))
            lines.append(f"{flag} ({ENV_PREFIX}{name.upper()}): {message}, got {shown}")
        else:
            lines.append(message)
    return "; ".join(lines)


def settings_or_exit(argv: Sequence[str] | None = None) -> Settings:
    """load_settings for a command line: a bad value prints one clean line and exits with status 2."""
    try:
        return load_settings(argv)
    except ConfigError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
