"""The Codex CLI (`@openai/codex`, installed into its own cached npm prefix) against a real server: `codex exec`
with a model provider whose `wire_api` is `responses` finishes a turn without a protocol error.

Codex's own instructions and tools are ~10k tokens; the config replaces its instructions with a short file and
turns off its sub-agent and goal tools and hosted web search (which Peregrine refuses with a 400), so the
request fits a 4096-token context. The server is its own (the session's serves 2048 tokens)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.api.conftest import SERVER_ARGS
from tests.interop.npm import ensure_npm_tool
from tests.support import free_port, server_env, stop_process, wait_http_ok

pytestmark = [pytest.mark.slow, pytest.mark.interop]
REPO = Path(__file__).resolve().parents[2]
CONFIG = """model = "{model}"
model_provider = "peregrine"
web_search = "disabled"
model_instructions_file = "{instructions}"

[features]
multi_agent = false
goals = false

[model_providers.peregrine]
name = "Peregrine"
base_url = "{base_url}/v1"
wire_api = "responses"
"""


@pytest.fixture(scope="module")
def codex_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    workdir = tmp_path_factory.mktemp("codex-server")
    port, log_path = free_port(), workdir / "server.log"
    args = [a if a != "2048" else "4096" for a in SERVER_ARGS]  # --max-model-len 4096
    cmd = [sys.executable, str(REPO / "main.py"), "--host", "127.0.0.1", "--port", str(port), *args,
           "--store-path", str(workdir / "store.db")]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, cwd=workdir, env=server_env(), stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_http_ok(f"http://127.0.0.1:{port}/ready", proc, log_path, 900)
        yield f"http://127.0.0.1:{port}"
    finally:
        stop_process(proc, 60)


def test_codex_exec_finishes_a_turn(codex_server: str, tmp_path: Path) -> None:
    codex = ensure_npm_tool("@openai/codex", "codex")
    home, work = tmp_path / "codex-home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    instructions = home / "instructions.md"
    instructions.write_text("You are a coding assistant. Reply with one short sentence.\n")
    model = "smollm2"
    (home / "config.toml").write_text(CONFIG.format(model=model, instructions=instructions, base_url=codex_server))
    env = {**os.environ, "CODEX_HOME": str(home), "NO_COLOR": "1"}
    done = subprocess.run([str(codex), "exec", "--skip-git-repo-check", "Say hi."], cwd=work, env=env,
                          stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=900)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-3000:]
    assert "ERROR" not in output and "tokens used" in output, output[-3000:]
    assert "\ncodex\n" in output, output[-3000:]  # the agent's message, after the "codex" heading
