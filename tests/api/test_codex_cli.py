"""The Codex CLI (`@openai/codex`, installed into its own cached npm prefix) against a real server: `codex exec`
with a model provider whose `wire_api` is `responses` finishes a turn without a protocol error.

Codex's own instructions and tools are ~10k tokens; the config replaces its instructions with a short file and
turns off its sub-agent and goal tools and hosted web search (which Peregrine refuses with a 400), so the
request fits a 4096-token context. The server is `greedy_server` (tests/api/conftest.py): 4096 tokens, and greedy
for requests that send no temperature, as Codex's do (at OpenAI's default 1.0 the 135M model can ramble to the end
of the context, which Codex reports as an error)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests.interop.npm import ensure_npm_tool

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


def test_codex_exec_finishes_a_turn(greedy_server: str, tmp_path: Path) -> None:
    codex = ensure_npm_tool("@openai/codex", "codex")
    home, work = tmp_path / "codex-home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    instructions = home / "instructions.md"
    instructions.write_text("You are a coding assistant. Reply with one short sentence.\n")
    model = "smollm2"
    (home / "config.toml").write_text(CONFIG.format(model=model, instructions=instructions, base_url=greedy_server))
    env = {**os.environ, "CODEX_HOME": str(home), "NO_COLOR": "1"}
    done = subprocess.run([str(codex), "exec", "--skip-git-repo-check", "Say hi."], cwd=work, env=env,
                          stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=900)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-3000:]
    assert "ERROR" not in output and "tokens used" in output, output[-3000:]
    assert "\ncodex\n" in output, output[-3000:]  # the agent's message, after the "codex" heading
