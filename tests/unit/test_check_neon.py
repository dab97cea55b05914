"""scripts/check_neon.py: the kernels' NEON backend compiles for aarch64 (zig's clang, from any x86 machine).

Needs a Python with the `ziglang` package: this one, or the one `PEREGRINE_ZIG_PYTHON` names (docs/testing.md, "The
aarch64 build"); skipped, with the reason, where there is none. The suite compiles the probe only (vec.h picked NEON,
and the int8 dot products over it, none of which include torch's headers: seconds); the files that include torch's
headers take minutes each, so `python scripts/check_neon.py` checks every file outside the suite."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "check_neon.py"
_spec = importlib.util.spec_from_file_location("check_neon", SCRIPT)
assert _spec is not None and _spec.loader is not None
check_neon = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(check_neon)


def _zig_python() -> str | None:
    named = os.environ.get("PEREGRINE_ZIG_PYTHON")
    if named:
        return named
    return sys.executable if importlib.util.find_spec("ziglang") is not None else None


ZIG = _zig_python()


@pytest.mark.slow
@pytest.mark.skipif(ZIG is None, reason="no ziglang here (install it in a venv and set PEREGRINE_ZIG_PYTHON)")
def test_the_kernels_compile_for_aarch64_neon() -> None:
    assert ZIG is not None
    ok = subprocess.run([ZIG, "-m", "ziglang", "version"], capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    failures = check_neon.check(ZIG, [])  # the probe: vec.h's NEON backend and qdot.h's kernels
    assert failures == [], failures


def test_a_broken_source_is_reported(tmp_path: Path) -> None:
    """The check fails loudly: a file that does not compile is returned with the compiler's words."""
    if ZIG is None:
        pytest.skip("no ziglang here (install it in a venv and set PEREGRINE_ZIG_PYTHON)")
    broken = tmp_path / "broken.cpp"
    broken.write_text("this is not C++;\n")
    (failure,) = [f for f in check_neon.check(ZIG, [broken]) if f[0] == broken]
    assert "error" in failure[1]
