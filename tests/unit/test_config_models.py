"""Which models a server serves: `--model` given more than once, a models file (YAML or JSON), per-model values
validated like their flags, and Ollama-style keep-alive durations."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from config import ConfigError, load_settings, parse_duration, repeated_model_flags
from config.models_file import model_entries


@pytest.fixture
def clean_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)  # no developer .env
    for key in list(__import__("os").environ):
        if key.startswith("PEREGRINE_"):
            monkeypatch.delenv(key)
    return tmp_path


def test_model_given_twice_serves_both(clean_env: Path) -> None:
    assert repeated_model_flags(["--model", "a", "--port", "1", "--model=b"]) == [
        "--model", "a", "--port", "1", "--extra-models", "b"]  # fmt: skip
    settings = load_settings(["--model", "org/a", "--model", "org/b", "--served-model-name", "first"])
    assert settings.multi_model and settings.extra_models == ["org/b"]
    entries = model_entries(settings)
    assert [e.name for e in entries] == ["first", "org/b"]  # --served-model-name names the first only
    assert entries[1].settings.model == "org/b" and entries[1].settings.port == settings.port
    assert not load_settings(["--model", "org/a"]).multi_model  # one model: the single-engine path


def test_models_file_yaml_with_per_model_values(clean_env: Path) -> None:
    (clean_env / "models.yaml").write_text(
        "models:\n"
        "  - model: bundled:smollm2\n    kv_cache_bytes: 256MiB\n    keep_alive: 10m\n"
        "  - model: /models/tiny\n    name: tiny\n    max_model_len: 256\n    chat_template: qwen3\n"
        "  - org/other\n"
    )
    entries = model_entries(load_settings(["--models-file", "models.yaml", "--max-model-len", "1024"]))
    assert [e.name for e in entries] == ["smollm2", "tiny", "org/other"]  # no --model: the file's only
    assert int(entries[0].settings.kv_cache_bytes) == 256 * 2**20 and entries[0].keep_alive_s == 600.0
    assert entries[1].settings.max_model_len == 256 and entries[1].keep_alive_s is None
    assert entries[1].settings.chat_template == "qwen3" and entries[0].settings.chat_template is None
    assert entries[2].settings.max_model_len == 1024  # the server's value where the entry sets none


def test_models_file_json_after_explicit_model(clean_env: Path) -> None:
    (clean_env / "models.json").write_text(json.dumps([{"model": "org/b", "name": "b"}]))
    entries = model_entries(load_settings(["--model", "org/a", "--models-file", "models.json"]))
    assert [e.name for e in entries] == ["org/a", "b"]


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("models:\n  - model: a\n    max_model_len: 3\n", "model 1: max_model_len: Input should be greater"),
        ("models:\n  - {model: a, colour: red}\n", "unknown key(s) colour"),
        ("models:\n  - {name: a}\n", "each entry needs 'model'"),
        ("models:\n  - {model: a, keep_alive: soon}\n", "keep_alive must be a duration"),
        ("models:\n  - {model: a}\n  - {model: b, name: a}\n", "two models are served as a"),
        ("models: 3\n", "expected a list of models"),
        ("models: [\n", "cannot read it"),
    ],
)
def test_bad_models_file_is_one_clear_line(clean_env: Path, text: str, says: str) -> None:
    (clean_env / "models.yaml").write_text(text)
    with pytest.raises(ConfigError) as err:
        model_entries(load_settings(["--models-file", "models.yaml"]))
    assert says in str(err.value) and "models.yaml" in str(err.value)


@pytest.mark.parametrize(
    ("value", "seconds"),
    [("5m", 300.0), ("30s", 30.0), ("1h30m", 5400.0), ("500ms", 0.5), ("0", 0.0), (120, 120.0), ("2.5", 2.5),
     ("-1", -1.0), (-5, -1.0), ("-5m", -1.0)],
)  # fmt: skip
def test_keep_alive_durations(value: object, seconds: float) -> None:
    assert parse_duration(value) == seconds


@pytest.mark.parametrize("value", ["soon", "5 minutes", "", "m5", True, None])
def test_bad_keep_alive(value: object, clean_env: Path) -> None:
    with pytest.raises(ValueError):
        parse_duration(value)
    if isinstance(value, str):
        with pytest.raises(ConfigError, match="--model-keep-alive"):
            load_settings(["--model-keep-alive", value])


def test_main_refuses_a_bad_models_file_in_one_line(clean_env: Path) -> None:
    import subprocess
    import sys

    (clean_env / "models.yaml").write_text("models:\n  - {model: a, colour: red}\n")
    main = Path(__file__).resolve().parents[2] / "main.py"
    done = subprocess.run([sys.executable, str(main), "--models-file", "models.yaml"], cwd=clean_env,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 1
    assert "--models-file models.yaml, model 1: unknown key(s) colour" in done.stderr
