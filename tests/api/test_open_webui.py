"""Open WebUI against Peregrine, as both its Ollama and its OpenAI backend, driven in headless Chromium: its model
list shows Peregrine's model, and a chat streams an answer.

Open WebUI (`pip install open-webui`, heavy: torch and friends) lives in its own cached venv
(tests/interop/venvs.py: built once, under ~/.cache/peregrine/interop-venvs/), never in the server's. It is started
offline: no login (WEBUI_AUTH=False), no Hub (HF_HUB_OFFLINE, OFFLINE_MODE), no model download at start (embeddings
through Peregrine's own /api/embed, RAG_EMBEDDING_ENGINE=ollama; no reranker, no whisper), no telemetry, no update
check, and the background title / tag / follow-up generations off, so the test's one short chat is all the load.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from playwright.sync_api import TimeoutError as PlaywrightTimeout

from tests.api._browser import browser_fixture, page_fixture  # noqa: F401 - the browser and page fixtures
from tests.interop.venvs import VenvSpec, ensure_venv
from tests.support import free_port, stop_process, wait_http_ok

pytestmark = [
    pytest.mark.slow, pytest.mark.interop, pytest.mark.timeout(3600),
]
# Python 3.11 and torch first: this machine's registry has torch's CPU wheel for 3.11 only (`torch==2.13.0` picks
# 2.13.0+cpu), where any other resolution pulls CUDA's wheels (gigabytes) for sentence-transformers. ~15 min, 2.9 GB.
OPEN_WEBUI = VenvSpec("open-webui", "3.11", ("torch==2.13.0", "open-webui==0.12.4"))
START_S = 600.0  # its first start migrates its database and imports a lot: minutes on a busy 2-core machine


def offline_env(data: Path, peregrine: str, model: str, embedder: str) -> dict[str, str]:
    keep = {k: v for k, v in os.environ.items() if k in ("PATH", "HOME", "LANG", "TMPDIR")}
    return keep | {
        "DATA_DIR": str(data), "WEBUI_AUTH": "False", "DEFAULT_MODELS": model, "WEBUI_SECRET_KEY": "peregrine-test-secret",
        "OLLAMA_BASE_URL": peregrine, "ENABLE_OLLAMA_API": "True",
        "OPENAI_API_BASE_URL": f"{peregrine}/v1", "OPENAI_API_KEY": "none", "ENABLE_OPENAI_API": "True",
        "OFFLINE_MODE": "True", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
        "RAG_EMBEDDING_ENGINE": "ollama", "RAG_EMBEDDING_MODEL": embedder, "RAG_OLLAMA_BASE_URL": peregrine,
        "RAG_EMBEDDING_MODEL_AUTO_UPDATE": "False", "RAG_RERANKING_MODEL": "", "RAG_RERANKING_MODEL_AUTO_UPDATE": "False",
        "WHISPER_MODEL_AUTO_UPDATE": "False", "AUDIO_STT_ENGINE": "openai", "ENABLE_WEB_SEARCH": "False",
        "ANONYMIZED_TELEMETRY": "False", "DO_NOT_TRACK": "True", "SCARF_NO_ANALYTICS": "True",
        "ENABLE_VERSION_UPDATE_CHECK": "False", "ENABLE_TITLE_GENERATION": "False", "ENABLE_TAGS_GENERATION": "False",
        "ENABLE_FOLLOW_UP_GENERATION": "False", "ENABLE_AUTOCOMPLETE_GENERATION": "False",
        "ENABLE_EVALUATION_ARENA_MODELS": "False", "ENABLE_BASE_MODELS_CACHE": "False",
    }  # fmt: skip


@pytest.fixture(scope="module")
def open_webui(server: str, model_id: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    try:
        venv = ensure_venv(OPEN_WEBUI)
    except subprocess.CalledProcessError as exc:
        if subprocess.run(["pip", "index", "versions", "open-webui"], capture_output=True, timeout=120).returncode:
            pytest.skip(f"the package registry cannot be reached to install open-webui: {exc}")
        raise
    embedder = next(m["name"] for m in httpx.get(f"{server}/api/tags", timeout=60).json()["models"]
                    if m["details"]["family"] == "bert")  # fmt: skip
    data = tmp_path_factory.mktemp("open-webui")
    port = free_port()
    log_path = data / "open-webui.log"
    cmd = [str(venv / "bin" / "open-webui"), "serve", "--host", "127.0.0.1", "--port", str(port)]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, cwd=data, env=offline_env(data, server, model_id, embedder), stdout=log,
                                stderr=subprocess.STDOUT)  # fmt: skip
    try:
        wait_http_ok(f"http://127.0.0.1:{port}/health", proc, log_path, START_S, what="Open WebUI")
        yield f"http://127.0.0.1:{port}"
    finally:
        stop_process(proc, 60)


def test_open_webui_lists_peregrine_models_from_both_backends_and_streams_a_chat(
    page, open_webui: str, model_id: str
) -> None:
    page.goto(open_webui)
    page.wait_for_function("() => !!localStorage.token")  # WEBUI_AUTH=False: signed in as the admin at once
    # Each backend's own list (Open WebUI's proxies of Peregrine's /v1/models and /api/tags); the merged model list
    # holds one entry per id, so the same model from both backends shows once there.
    get = "async (path) => (await fetch(path, {headers: {Authorization: 'Bearer ' + localStorage.token}})).json()"
    openai_ids = [m["id"] for m in page.evaluate(get, "/openai/models")["data"]]
    ollama_ids = [m["model"] for m in page.evaluate(get, "/ollama/api/tags")["models"]]
    assert model_id in openai_ids and model_id in ollama_ids, (openai_ids, ollama_ids)
    merged = [m["id"] for m in page.evaluate(get, "/api/models")["data"]]
    assert model_id in merged, merged
    dialog = page.locator("div[role=dialog]")  # a first sign-in opens Open WebUI's "what's new" dialog
    with contextlib.suppress(PlaywrightTimeout):
        dialog.first.wait_for(state="visible", timeout=15_000)
    if dialog.count():
        page.keyboard.press("Escape")
        dialog.first.wait_for(state="detached")
    page.locator("#chat-input").click()
    page.keyboard.type("Say hello.")
    page.keyboard.press("Enter")
    answer = page.locator("#response-content-container").last
    answer.wait_for()
    page.wait_for_function(  # the answer has streamed in and the turn is over (the stop button is gone)
        "() => { const a = [...document.querySelectorAll('#response-content-container')].pop();"
        " return a && a.innerText.trim().length > 0 && !document.querySelector('#stop-response-button'); }"
    )
    assert answer.inner_text().strip()
