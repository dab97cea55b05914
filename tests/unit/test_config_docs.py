"""docs/configuration.md is generated from config.Settings (scripts/gen_config_docs.py) and must not drift from it."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from config import CONVENTIONAL_ENV, ENV_PREFIX, Settings

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "gen_config_docs.py"
PAGE = REPO / "docs" / "configuration.md"


@pytest.fixture(scope="module")
def gen() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gen_config_docs", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_configuration_page_is_up_to_date(gen: ModuleType) -> None:
    assert PAGE.read_text(encoding="utf-8") == gen.render(), (
        f"docs/configuration.md is out of date with config.Settings: run `{gen.COMMAND}` and commit the result"
    )


def test_every_setting_has_its_row(gen: ModuleType) -> None:
    rows = [line for line in gen.render().splitlines() if line.startswith("| `--")]
    assert len(rows) == len(Settings.model_fields)
    for row, (name, field) in zip(rows, Settings.model_fields.items(), strict=True):
        assert row.startswith(f"| `--{name.replace('_', '-')}`"), row
        assert f"`{ENV_PREFIX}{name.upper()}`" in row
        assert gen.cell(field.description or "") in row
        if name in CONVENTIONAL_ENV:
            assert f"`{CONVENTIONAL_ENV[name]}`" in row


def test_defaults_and_choices_are_shown(gen: ModuleType) -> None:
    rows = {line.split(" | ")[0]: line for line in gen.render().splitlines() if line.startswith("| `--")}
    assert "| `8000` |" in rows["| `--port`"] and "at most 65535" in rows["| `--port`"]
    assert "| `bundled:smollm2` |" in rows["| `--model`"]
    assert "| `true` |" in rows["| `--prefix-caching` / `--no-prefix-caching`"]
    assert "| unset |" in rows["| `--kv-cache-bytes`"]
    assert "`auto`, `float32`, `bfloat16`, `float16`" in rows["| `--dtype`"]
    # escaped: a bare <think> would vanish as an HTML tag
    assert "&lt;think>" in rows["| `--reasoning-parser`"]


def test_check_names_the_command_when_stale(tmp_path: Path, gen: ModuleType) -> None:
    stale = tmp_path / "configuration.md"
    stale.write_text(gen.render().replace("`--port`", "`--old-port`"), encoding="utf-8")
    cmd = [sys.executable, str(SCRIPT), "--check", "--output", str(stale)]
    failed = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
    assert failed.returncode == 1
    assert gen.COMMAND in failed.stderr
    rewrite = subprocess.run(cmd[:2] + ["--output", str(stale)], capture_output=True, text=True, timeout=120)
    assert rewrite.returncode == 0, rewrite.stderr
    assert subprocess.run(cmd, capture_output=True, timeout=120, check=False).returncode == 0
    assert stale.read_text(encoding="utf-8") == gen.render()
