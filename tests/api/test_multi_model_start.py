"""The several-models start loads its default model as reliably as the one-model start (issue 34).

`python main.py --model bundled:smollm2 --model other.gguf` once came up with the default model unloaded and
`last_error` "ImportError: cannot import name 'AutoTokenizer' from 'transformers'": the embedding model and the
default model loaded in two threads that imported transformers at once. The start now imports the loaders'
libraries once before any loader thread starts (models/acquire.py: `import_libraries`). A race shows only
sometimes, so the real server is started several times, each a subprocess on a free loopback port, with the
embedding model on (the second loader thread) and no request sent: the default model must load at start, and
without an error, every time.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import httpx
import pytest

from models.hub import bundled_path
from tests.support import main_server

pytestmark = pytest.mark.slow

WAIT_S = 600.0  # a SmolLM2 load beside the embedding model on a busy 2-core machine can take a while
STARTS = 2


@pytest.fixture(scope="module")
def other_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A second local GGUF model: the bundled SmolLM2 file under another name (a link, served as `other`)."""
    path = tmp_path_factory.mktemp("other") / "other.gguf"
    path.symlink_to(bundled_path("smollm2"))
    return path


def _log(path: Path) -> str:
    """The server's log without uvicorn's access lines (the polling here writes one a second)."""
    lines = path.read_text(errors="replace").splitlines()
    return "\n".join(line for line in lines if "uvicorn.access" not in line)[-8000:]


def _default_model(http: httpx.Client) -> dict:
    models = {m["id"]: m for m in http.get("/v1/models").json()["data"] if "state" in m}  # the embedder has none
    assert list(models) == ["smollm2", "other"]
    return models["smollm2"]


def _settled(http: httpx.Client, log_path: Path) -> dict:
    """The default model once its start-up load has finished, one way or the other (no request is sent)."""
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        model = _default_model(http)
        if model["state"] == "loaded" or model["status"]["last_error"] is not None:
            return model
        time.sleep(1.0)
    pytest.fail(f"the default model never finished loading:\n{_log(log_path)}")


def _embeds(http: httpx.Client, log_path: Path) -> None:
    """The embedding model, loaded in its own thread beside the default model, answers too."""
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        r = http.post("/v1/embeddings", json={"input": "hello"})
        if r.status_code != 503:
            assert r.status_code == 200, r.text
            assert len(r.json()["data"][0]["embedding"]) == 384
            return
        time.sleep(1.0)
    pytest.fail(f"the embedding model never loaded:\n{_log(log_path)}")


@pytest.mark.parametrize("start", range(STARTS))
def test_the_default_model_loads_at_start_every_time(start: int, other_gguf: Path, tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PEREGRINE_")}
    args = ("--model", "bundled:smollm2", "--model", str(other_gguf), "--weight-format", "quantized",
            "--kv-cache-bytes", "64MiB", "--max-model-len", "2048", "--models-memory-budget", "2GiB")
    with main_server(tmp_path, *args, env=env, ready_timeout=WAIT_S) as (url, log_path), \
            httpx.Client(base_url=url, timeout=300, trust_env=False) as http:
        model = _settled(http, log_path)
        assert model["state"] == "loaded", f"start {start}: {model['status']}\n{_log(log_path)}"
        assert model["status"]["last_error"] is None and model["status"]["loads_total"] == 1
        assert _default_model(http)["state"] == "loaded"  # loaded at start, before any request named it
        _embeds(http, log_path)
        assert "Traceback" not in _log(log_path), _log(log_path)
