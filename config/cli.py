"""Reading the settings from a command line: flags, then environment and .env; a bad value as one clean line."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from pydantic import ValidationError
from pydantic_settings import SettingsError

from config.loading import ENV_PREFIX, PROG, ConfigError, repeated_model_flags
from config.settings import Settings

_SECRET_FIELDS = frozenset({"hf_token", "api_keys", "jwt_secret"})


def load_settings(argv: Sequence[str] | None = None) -> Settings:
    """Build Settings from flags (argv; None means sys.argv[1:]), env and .env. Raises ConfigError."""
    args = repeated_model_flags(list(sys.argv[1:] if argv is None else argv))
    try:
        return Settings(_cli_parse_args=args)
    except ValidationError as exc:
        raise ConfigError(_describe(exc)) from None
    except SettingsError as exc:
        raise ConfigError(f"bad settings: {exc}") from None


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
