"""Peregrine's settings: one frozen object, read once at start.

Sources, highest priority first: command-line flags (`--kebab-case`), environment variables
(`PEREGRINE_<NAME>`), the `.env` file in the working directory, then the defaults. The Hugging Face
token is also read from the conventional `HF_TOKEN` (environment or `.env`) when `PEREGRINE_HF_TOKEN` is
not set.

This package imports nothing else of Peregrine's and nothing heavy (no torch), so `python main.py --help` is
fast. Nothing else in the project reads `os.environ` for its own configuration. `settings.py` holds the fields,
`loading.py` the sources beside them (flags, the conventional variables, durations), `cli.py` reads a command
line and turns a bad value into one clean line, `models_file.py` reads `--models-file`.
"""

from config.cli import load_settings, settings_or_exit
from config.loading import (
    CONVENTIONAL_ENV,
    DEFAULT_CACHE_DIR,
    ENV_FILE,
    ENV_PREFIX,
    PROG,
    ConfigError,
    ConventionalEnvSource,
    parse_duration,
    repeated_model_flags,
    tool_cache_dir,
)
from config.settings import Settings, device_kind

__all__ = [
    "CONVENTIONAL_ENV", "DEFAULT_CACHE_DIR", "ENV_FILE", "ENV_PREFIX", "PROG", "ConfigError", "ConventionalEnvSource",
    "Settings", "device_kind", "load_settings", "parse_duration", "repeated_model_flags", "settings_or_exit",
    "tool_cache_dir",
]  # fmt: skip
