"""/api/pull and /api/delete's work (app/ollama/pull.py) against the local stand-in for the Hub of test_hub.py (never
the real Hub): Ollama's progress lines, the files in the download dir, the preflight's refusal, and what delete
removes or refuses. The routes themselves are exercised against a live server in tests/api/test_ollama_api.py."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest

from app.errors import APIError
from app.ollama import pull
from tests.unit.test_hub import FakeHub, Repo, model_repo, serving


@pytest.fixture
def hub() -> Iterator[FakeHub]:
    state = FakeHub(repos={"org/model": Repo(model_repo(), params=2000),
                           "org/huge": Repo(model_repo(), params=10**14)})  # fmt: skip
    with serving(state):
        yield state


@pytest.fixture
def settings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> SimpleNamespace:
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    return SimpleNamespace(download_dir=tmp_path / "downloads", cache_dir=tmp_path / "cache", dtype="float32",
                           hf_token_value=None, max_model_len=64, kv_cache_bytes=None)  # fmt: skip


def lines(model: str, settings: SimpleNamespace, hub: FakeHub) -> list[dict]:
    async def collect() -> list[dict]:
        return [line async for line in pull.pull_events(model, settings, endpoint=hub.url)]

    return asyncio.run(collect())


def test_pull_from_the_hub_streams_ollama_progress_and_fills_the_download_dir(hub, settings) -> None:
    out = lines("org/model:latest", settings, hub)
    assert out[0] == {"status": "pulling manifest"} and out[-1] == {"status": "success"}
    files = out[1:-1]
    weights = [f for f in files if f["status"] == "pulling model-00001-of-00002.safetensors"]
    assert [w["completed"] for w in weights] == [0, 3000] and all(w["total"] == 3000 for w in weights)
    assert all(f["digest"].startswith("sha256:") and len(f["digest"]) == 71 for f in files)
    fetched = {path.rsplit("/", 1)[-1] for method, path in hub.requests if method == "GET" and "/resolve/" in path}
    assert fetched == {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                                "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
                                "model.safetensors.index.json"}  # fmt: skip
    snapshot = next((settings.download_dir / "models--org--model" / "snapshots").iterdir())
    assert (snapshot / "model-00002-of-00002.safetensors").read_bytes() == b"v" * 1000

    again = lines("org/model", settings, hub)  # all cached: every file reported complete at once
    assert all(line.get("completed") == line.get("total") for line in again)


def test_pull_refuses_what_the_preflight_says_cannot_fit(hub, settings) -> None:
    with pytest.raises(APIError) as caught:
        lines("org/huge", settings, hub)
    assert caught.value.status_code == 400 and caught.value.code == "preflight_refused"
    assert "does not fit" in caught.value.message and "in RAM" in caught.value.message
    assert not any("/resolve/" in p and p.endswith(".safetensors") for _, p in hub.requests)  # nothing fetched


def test_pull_of_an_unknown_repo_is_an_error(hub, settings) -> None:
    with pytest.raises(APIError) as caught:
        lines("org/missing", settings, hub)
    assert caught.value.status_code == 400 and "not found" in caught.value.message


def test_delete_removes_only_what_was_downloaded(hub, settings, tmp_path: Path) -> None:
    lines("org/model", settings, hub)
    folder = settings.download_dir / "models--org--model"
    assert folder.is_dir()
    with pytest.raises(APIError) as served:
        asyncio.run(pull.delete("org/model", settings, served=["org/model"]))
    assert served.value.status_code == 400 and folder.is_dir()
    asyncio.run(pull.delete("org/model", settings, served=[]))
    assert not folder.exists()
    with pytest.raises(APIError) as gone:
        asyncio.run(pull.delete("org/model", settings, served=[]))
    assert gone.value.status_code == 404
    own = tmp_path / "mine.gguf"
    own.write_bytes(b"GGUF")
    for refused in ("bundled:smollm2", str(own)):
        with pytest.raises(APIError) as caught:
            asyncio.run(pull.delete(refused, settings, served=[]))
        assert caught.value.status_code == 400
    assert own.exists()
