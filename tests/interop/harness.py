"""Shared by the interop tests: run a driver script in its client's venv, Peregrine's own answers to compare
with, and the checks on what the modern client saw (directly, or through a Llama Stack server)."""

from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.interop.venvs import VenvSpec, ensure_venv

INTEROP = Path(__file__).resolve().parent
CLIENT_TIMEOUT_S = 600


def run_client(spec: VenvSpec, script: str, *args: str) -> dict[str, Any]:
    """Run a driver script with the client's own interpreter; return the JSON it printed."""
    python = ensure_venv(spec) / "bin" / "python"
    proc = subprocess.run([str(python), str(INTEROP / script), *args], capture_output=True, text=True,
                          timeout=CLIENT_TIMEOUT_S)  # fmt: skip
    assert proc.returncode == 0, f"{script} failed:\n{proc.stderr[-6000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def cosine(a: list[float], b: list[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b, strict=True))
    return dot / (math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in b)))


@pytest.fixture(scope="module")
def embedding_id(http: httpx.Client) -> str:
    data = http.get("/v1/models").json()["data"]
    return next(m["id"] for m in data if m["custom_metadata"]["model_type"] == "embedding")


@pytest.fixture(scope="module")
def direct(http: httpx.Client, model_id: str) -> dict[str, Any]:
    """Peregrine's own greedy answers and vectors for what the drivers ask, to compare with."""
    chat = {"model": model_id, "messages": [{"role": "user", "content": "Name a colour."}], "temperature": 0}
    completion = {"model": model_id, "prompt": "The capital of France is", "temperature": 0, "max_tokens": 6}
    texts = ["Falcons are fast.", "Peregrines dive at 300 km/h."]
    return {
        "chat": http.post("/v1/chat/completions", json=chat | {"max_tokens": 8}).json()["choices"][0][
            "message"
        ]["content"],
        "completion": http.post("/v1/completions", json=completion).json()["choices"][0]["text"],
        "embeddings": [
            d["embedding"] for d in http.post("/v1/embeddings", json={"input": texts}).json()["data"]
        ],
    }


def check_generation(seen: dict[str, Any], direct: dict[str, Any]) -> None:
    assert seen["chat"]["content"] == direct["chat"] and seen["chat"]["finish_reason"] == "length"
    assert "".join(seen["chat_stream"]["deltas"]) == direct["chat"]
    assert seen["chat_stream"]["finish_reasons"] == ["length"]  # and the [DONE] ended the stream cleanly
    assert seen["chat_top_k_1"] == direct["chat"]  # top_k=1 at temperature 1.5 is greedy
    assert seen["completion"]["text"] == seen["completion_stream"]["text"] == direct["completion"]
    assert seen["completion_stream"]["finish_reasons"] == ["length"]


def check_embeddings(seen: dict[str, Any], direct: dict[str, Any]) -> None:
    assert len(seen["embeddings"]) == 2
    for got, expected in zip(seen["embeddings"], direct["embeddings"], strict=True):
        assert cosine(got, expected) > 0.99999
    short = seen["embedding_b64_64"]
    assert len(short) == 64 and math.isclose(sum(x * x for x in short), 1.0, rel_tol=1e-4)
    assert cosine(short, direct["embeddings"][0][:64]) > 0.9999
