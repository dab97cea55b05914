"""Stored responses through a real server (`python main.py`, the tiny random model: the store is what is
tested, not the answers): they survive a restart, a `previous_response_id` continues across it, and the store
keeps at most `--store-max-objects`, dropping the oldest first."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from tests.api._tiny_server import TinyServer

pytestmark = pytest.mark.slow


def _create(server: TinyServer, **body: object) -> dict:
    response = httpx.post(f"{server.url}/v1/responses", json={"input": "hi", "max_output_tokens": 3, **body},
                          timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def _status(server: TinyServer, response_id: str) -> int:
    return httpx.get(f"{server.url}/v1/responses/{response_id}", timeout=60).status_code


def test_stored_responses_survive_a_restart_and_stay_bounded(tiny_model_dir, tmp_path: Path) -> None:
    args = ("--max-model-len", "256", "--kv-cache-bytes", "2MiB", "--store-path", str(tmp_path / "store.db"),
            "--store-max-objects", "3")
    server = TinyServer(tiny_model_dir.path, tmp_path, *args)
    try:
        server.wait_ready()
        first = _create(server)
        chain = [_create(server, previous_response_id=first["id"])]
        chain += [_create(server, previous_response_id=chain[-1]["id"]) for _ in range(2)]
        assert _status(server, first["id"]) == 404  # four stored, three kept: the oldest went first
        assert all(_status(server, r["id"]) == 200 for r in chain)
    finally:
        server.stop()
    server = TinyServer(tiny_model_dir.path, tmp_path, *args)
    try:
        server.wait_ready()
        kept = httpx.get(f"{server.url}/v1/responses/{chain[-1]['id']}", timeout=60).json()
        assert kept == chain[-1]
        after = _create(server, previous_response_id=chain[-1]["id"])
        assert after["previous_response_id"] == chain[-1]["id"]
        assert after["usage"]["input_tokens"] > chain[-1]["usage"]["input_tokens"]  # the history came back
    finally:
        server.stop()
