"""A real Llama Stack server (llama-stack 0.7.x, Python 3.12) whose only inference provider is Peregrine.

The stack runs `examples/llama-stack-run.yaml` (the file the README shows) with `PEREGRINE_URL` pointing at
the test server's /v1, on a free loopback port, from its own cached virtual environment; it is stopped by
its PID. llama-stack-client 0.7.x then talks to the stack only, and must get Peregrine's answers.
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.interop.harness import check_embeddings, check_generation, direct, embedding_id, run_client
from tests.interop.venvs import CLIENT_MODERN, SERVER, ensure_venv
from tests.support import free_port, server_env, stop_process, wait_http_ok

# A first run builds the clients' (and the stack's) venvs inside setup: allow for it beyond the default 900 s.
pytestmark = [pytest.mark.slow, pytest.mark.interop, pytest.mark.timeout(3600)]
__all__ = ["direct", "embedding_id"]  # fixtures, imported so pytest finds them here
RUN_YAML = Path(__file__).resolve().parents[2] / "examples" / "llama-stack-run.yaml"
START_TIMEOUT_S = 300


@pytest.fixture(scope="module")
def stack(server: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    yield from run_stack(server, tmp_path_factory.mktemp("llama-stack"), RUN_YAML)


@pytest.fixture(scope="module")
def discovering_stack(server: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The same run config without its `registered_resources` (no `models:` list): the stack finds
    Peregrine's models by listing /v1/models, and its remote::vllm adapter types them by name."""
    workdir = tmp_path_factory.mktemp("llama-stack-discovery")
    config = yaml.safe_load(RUN_YAML.read_text())
    config.pop("registered_resources")
    run_yaml = workdir / "run.yaml"
    run_yaml.write_text(yaml.safe_dump(config))
    yield from run_stack(server, workdir, run_yaml)


def run_stack(server: str, workdir: Path, run_yaml: Path) -> Iterator[str]:
    venv = ensure_venv(SERVER)
    port = free_port()
    env = server_env("LLAMA_STACK_")
    env |= {"PEREGRINE_URL": f"{server}/v1", "SQLITE_STORE_DIR": str(workdir / "store"), "HOME": str(workdir),
            "LLAMA_STACK_HOST": "127.0.0.1"}  # fmt: skip
    log = workdir / "stack.log"
    cmd = [str(venv / "bin" / "llama"), "stack", "run", str(run_yaml), "--port", str(port)]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, cwd=workdir, env=env, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http_ok(f"{url}/v1/health", proc, log, START_TIMEOUT_S, what="llama stack")
        yield url
    finally:
        stop_process(proc, 60)


def test_llama_stack_serves_peregrine(
    stack: str, model_id: str, embedding_id: str, direct: dict[str, Any]
) -> None:
    llm_id, emb_id = f"peregrine/{model_id}", f"peregrine/{embedding_id}"
    seen = run_client(
        CLIENT_MODERN, "lsc_modern.py", stack, llm_id, emb_id, "models,chat,completions,embeddings"
    )
    assert seen["models"][llm_id]["model_type"] == "llm"
    assert seen["models"][llm_id]["provider_resource_id"] == model_id
    assert seen["models"][emb_id]["model_type"] == "embedding"
    assert seen["retrieve_embedding"]["provider_resource_id"] == embedding_id
    check_generation(seen, direct)
    check_embeddings(seen, direct)


def test_llama_stack_discovers_the_embedding_model_without_a_models_list(
    discovering_stack: str, model_id: str, embedding_id: str, direct: dict[str, Any]
) -> None:
    assert "embed" in embedding_id  # the default served name is one remote::vllm types as an embedding model
    llm_id, emb_id = f"peregrine/{model_id}", f"peregrine/{embedding_id}"
    seen = run_client(CLIENT_MODERN, "lsc_modern.py", discovering_stack, llm_id, emb_id, "models,embeddings")
    assert seen["models"][llm_id]["model_type"] == "llm"
    assert seen["models"][emb_id]["model_type"] == "embedding"
    check_embeddings(seen, direct)
