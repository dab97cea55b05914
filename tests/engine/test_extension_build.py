"""engine.backends.build: a build is keyed by what it compiles (bytes, flags, torch), not by its sources' path,
so a fresh clone or a worktree loads the modules another checkout built instead of compiling them again.

The module built here is a few lines of the Python C API (no torch headers: it compiles in about a second) going
through the same `build_extension` as the real kernels."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest

from engine.backends import build as extension_build
from engine.backends import cpu_kernels

TINY = """#include <Python.h>
static PyObject* answer(PyObject*, PyObject*) { return PyLong_FromLong(TINY_ANSWER); }
static PyMethodDef methods[] = {{"answer", answer, METH_NOARGS, "the answer"}, {nullptr, nullptr, 0, nullptr}};
static PyModuleDef module = {PyModuleDef_HEAD_INIT, "tiny", nullptr, -1, methods};
#define INIT2(name) PyInit_##name
#define INIT(name) INIT2(name)
PyMODINIT_FUNC INIT(TORCH_EXTENSION_NAME)() { return PyModule_Create(&module); }
"""


def checkout(root: Path, answer: int = 42) -> Path:
    """A csrc folder as a checkout holds it: a source and a header beside it."""
    root.mkdir(parents=True)
    (root / "tiny.h").write_text(f"#define TINY_ANSWER {answer}\n")
    (root / "tiny.cpp").write_text('#include "tiny.h"\n' + TINY)
    return root / "tiny.cpp"


def test_the_key_is_the_bytes_not_the_path(tmp_path: Path) -> None:
    flags = extension_build.level_flags("none")
    first, second = checkout(tmp_path / "a"), checkout(tmp_path / "elsewhere" / "b")
    assert extension_build.build_key([first], flags) == extension_build.build_key([second], flags)
    (second.parent / "tiny.h").write_text("#define TINY_ANSWER 7\n")  # a header is part of the build
    assert extension_build.build_key([first], flags) != extension_build.build_key([second], flags)
    assert extension_build.build_key([first], flags) != extension_build.build_key([first], [*flags, "-O2"])


def has_compiler() -> bool:
    from torch.utils.cpp_extension import get_cxx_compiler

    try:
        get_cxx_compiler()
    except RuntimeError:
        return False
    return True


@pytest.mark.skipif(not has_compiler(), reason="no C++ compiler")
def test_another_checkout_loads_the_same_build(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    cache = tmp_path / "cache"
    with caplog.at_level(logging.INFO, logger="engine.backends.build"):
        module = extension_build.build_extension("peregrine_tiny", [checkout(tmp_path / "one")], "none", cache)
    assert module.answer() == 42 and "compiling peregrine_tiny for none" in caplog.text
    (build_dir,) = (cache / "kernels").iterdir()
    built = (build_dir / "peregrine_tiny_none.so").stat().st_mtime_ns
    shutil.rmtree(tmp_path / "one")  # the first checkout is gone: the build reads its own copies
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="engine.backends.build"):
        again = extension_build.build_extension("peregrine_tiny", [checkout(tmp_path / "two")], "none", cache)
    assert again.answer() == 42 and "compiling" not in caplog.text
    assert list((cache / "kernels").iterdir()) == [build_dir]
    assert (build_dir / "peregrine_tiny_none.so").stat().st_mtime_ns == built  # not compiled again
    assert sorted(p.name for p in (build_dir / "src").iterdir()) == ["tiny.cpp", "tiny.h"]


@pytest.mark.skipif(not has_compiler(), reason="no C++ compiler")
def test_a_finished_build_is_imported_without_the_builder(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A fresh clone has its own venv, so torch's builder would find its ninja file naming other include folders
    and compile again; a finished build is imported as it is. One without the marker (its builder was killed
    midway, the library may be partial) is built again."""
    cache = tmp_path / "cache"  # (another module name: torch renames a name it has built in this process)
    extension_build.build_extension("peregrine_tiny_again", [checkout(tmp_path / "one")], "none", cache)
    (build_dir,) = (cache / "kernels").iterdir()
    library = build_dir / "peregrine_tiny_again_none.so"
    built = library.stat().st_mtime_ns
    for name in ("build.ninja", ".ninja_log"):  # what the builder would compare is gone
        (build_dir / name).unlink()
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="engine.backends.build"):
        again = extension_build.build_extension("peregrine_tiny_again", [checkout(tmp_path / "two")], "none", cache)
    assert again.answer() == 42 and "compiling" not in caplog.text and library.stat().st_mtime_ns == built
    (build_dir / extension_build.BUILT).unlink()
    with caplog.at_level(logging.INFO, logger="engine.backends.build"):
        rebuilt = extension_build.build_extension("peregrine_tiny_again", [checkout(tmp_path / "three")], "none", cache)
    assert rebuilt.answer() == 42 and "compiling peregrine_tiny_again for none" in caplog.text
    assert (build_dir / extension_build.BUILT).exists()


def test_the_none_level_is_no_build_of_the_cpu_kernels(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """"none" (the quantized-weight kernels' portable build) must not turn the CPU kernels on where the CPU has
    neither AVX2 nor NEON."""
    assert extension_build.level_flags("none") == extension_build.BASE_FLAGS
    with caplog.at_level(logging.WARNING, logger="engine.backends.cpu_kernels"):
        assert cpu_kernels.load(tmp_path, level="none") is None
    assert "no none build" in caplog.text and not (tmp_path / "kernels").exists()
