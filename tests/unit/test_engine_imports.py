"""The engine's import rules (STYLE.md): engine/ imports neither models/ nor config/ (nor the HTTP side), and
engine/core (scheduler, block manager, sequence, stopping, detokenizer, outputs) imports no torch. Each is checked
in a fresh interpreter, where nothing else has imported those packages yet."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FORBIDDEN = ("models", "config", "app", "serving", "main", "main_models")


def modules_after(imports: str) -> set[str]:
    code = f"import sys\n{imports}\nprint('\\n'.join(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                         check=True).stdout
    return set(out.split())


def test_engine_core_imports_no_torch() -> None:
    core = sorted(p.stem for p in (ROOT / "engine" / "core").glob("*.py") if p.stem != "__init__")
    loaded = modules_after("\n".join(f"import engine.core.{name}" for name in core))
    assert {f"engine.core.{name}" for name in core} <= loaded
    assert "torch" not in loaded


def test_the_whole_engine_loads_without_models_or_config() -> None:
    loaded = modules_after("import engine.llm_engine, engine.async_engine, engine.backends.devices, "
                           "engine.backends.cpu_kernels, engine.model.forward")
    assert "engine.llm_engine" in loaded
    assert not {m for m in loaded if m.split(".")[0] in FORBIDDEN}


@pytest.mark.parametrize("path", sorted((ROOT / "engine").rglob("*.py")), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_engine_file_names_models_or_config(path: Path) -> None:
    """Also imports inside functions, which the fresh-interpreter checks above would only see when called."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    assert not names & set(FORBIDDEN), sorted(names & set(FORBIDDEN))
    assert len(path.read_text().splitlines()) <= 400  # a file past 400 lines hides two modules (STYLE.md)
