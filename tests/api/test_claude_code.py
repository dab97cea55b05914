"""Claude Code (`@anthropic-ai/claude-code`, installed from npm into its own cached prefix: tests/interop/npm.py)
runs `claude -p` against a real Peregrine with `ANTHROPIC_BASE_URL` and any `ANTHROPIC_API_KEY`, and finishes a
turn without a protocol error.

What it sends (Claude Code 2.1): `POST /v1/messages?beta=true`, streamed, `max_tokens` 32000, `thinking`
adaptive, `context_management`, `output_config`, a `system` role turn mid-conversation (its
`mid-conversation-system` beta), and by default 24 tools (~64 kB of schemas) and ~6 kB of system prompt: about
21k tokens, past the bundled model's context. So the turn that must finish runs lean (`--bare --tools ""` and a
short `--system-prompt`); the default configuration must get a clean 400 that Claude Code reports as it is.
Offline: telemetry, error reporting, the auto-updater and other nonessential traffic are switched off by their
variables; anything it still tries to reach goes to a recording proxy that refuses it, and is printed.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.interop.npm import CLAUDE_CODE, RegistryUnreachable, ensure

pytestmark = [pytest.mark.slow, pytest.mark.interop, pytest.mark.timeout(1800)]
RUN_TIMEOUT_S = 600.0
OFFLINE_ENV = {
    "DISABLE_TELEMETRY": "1", "DISABLE_ERROR_REPORTING": "1", "DISABLE_AUTOUPDATER": "1",
    "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "DISABLE_NON_ESSENTIAL_MODEL_CALLS": "1",
    "DISABLE_BUG_COMMAND": "1", "CLAUDE_CODE_MAX_OUTPUT_TOKENS": "400",  # room to end a sampled turn (at 48 one ran out: an error)
}  # fmt: skip


@pytest.fixture(scope="module")
def claude_bin() -> Path:
    try:
        return ensure(CLAUDE_CODE, "claude")
    except RegistryUnreachable as exc:
        pytest.skip(f"Claude Code cannot be installed: {exc}")


class RefusingProxy:
    """An HTTP(S) proxy on loopback that records each request line (`CONNECT host:443`, `GET http://...`) and
    answers 403: where a client tries to go when it should stay offline."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.seen: list[str] = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                conn.settimeout(10)
                try:
                    self.seen.append(conn.recv(4096).split(b"\r\n", 1)[0].decode("latin-1"))
                    conn.sendall(b"HTTP/1.1 403 Forbidden\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
                except OSError:
                    pass

    def close(self) -> None:
        self.sock.close()


@pytest.fixture()
def proxy() -> Iterator[RefusingProxy]:
    p = RefusingProxy()
    yield p
    p.close()
    print(f"Claude Code tried to reach, besides the server: {p.seen or 'nothing'}")


def _run(claude: Path, server: str, model_id: str, home: Path, proxy: RefusingProxy, *args: str) -> tuple[int, str]:
    proxy_url = f"http://127.0.0.1:{proxy.port}"
    env = {
        "PATH": os.environ["PATH"], "HOME": str(home), "ANTHROPIC_BASE_URL": server, "ANTHROPIC_API_KEY": "sk-any",
        **{f"ANTHROPIC_{v}": model_id for v in ("MODEL", "SMALL_FAST_MODEL", "DEFAULT_HAIKU_MODEL",
                                                  "DEFAULT_SONNET_MODEL", "DEFAULT_OPUS_MODEL")},
        **{k: proxy_url for k in ("HTTPS_PROXY", "HTTP_PROXY", "https_proxy", "http_proxy")},
        "NO_PROXY": "127.0.0.1,localhost", "no_proxy": "127.0.0.1,localhost", **OFFLINE_ENV,
    }  # fmt: skip
    done = subprocess.run([str(claude), "-p", *args, "--output-format", "json"], cwd=home, env=env,
                          capture_output=True, text=True, timeout=RUN_TIMEOUT_S, stdin=subprocess.DEVNULL)
    return done.returncode, done.stdout + done.stderr


def _result(output: str) -> dict:
    return json.loads(output[output.index("{"):output.rindex("}") + 1])


def test_claude_code_finishes_a_turn(claude_bin: Path, greedy_server: str, model_id: str, tmp_path: Path,
                                     proxy: RefusingProxy) -> None:
    """Against the greedy server (temperature 0 for requests that send none): sampled, the 135M model's answer is a
    draw that depends on the prompt Claude Code writes (its date, the folder), and one such draw (a fresh-clone suite,
    2026-11-27) ran past the 400 tokens allowed, which Claude Code reports as an error; here it ended in 40 s."""
    rc, output = _run(claude_bin, greedy_server, model_id, tmp_path, proxy, "Say hello.", "--bare", "--tools", "",
                      "--system-prompt", "You are a helpful assistant. Answer in one short sentence.")
    assert rc == 0, output
    result = _result(output)
    assert result["type"] == "result" and result["subtype"] == "success" and result["is_error"] is False, result
    assert result["num_turns"] == 1 and result["result"].strip()
    assert result["usage"]["output_tokens"] > 0 and result["usage"]["input_tokens"] > 0


def test_claude_codes_full_prompt_gets_a_clear_400(claude_bin: Path, server: str, model_id: str, tmp_path: Path,
                                                    proxy: RefusingProxy) -> None:
    """All its tools and its own system prompt (~21k tokens) cannot fit the bundled model's context: a 400 saying
    so, which Claude Code reports as the turn's error (no retry loop, no protocol error)."""
    rc, output = _run(claude_bin, server, model_id, tmp_path, proxy, "Say hello.")
    assert rc != 0
    result = _result(output)
    assert result["is_error"] is True and "400" in result["result"] and "does not fit" in result["result"], result
