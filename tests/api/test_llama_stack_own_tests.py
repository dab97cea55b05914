"""Llama Stack's own integration tests against Peregrine directly: `test_inference_store*` of Llama Stack 0.7.3's
`tests/integration/inference/test_openai_completion.py` (from its sdist, run unchanged in its own venv with its
conftest), with `--stack-config` naming Peregrine's URL. They create chat completions through the openai SDK and
llama-stack-client (streamed and not, with and without tools) and find them again with `chat.completions.list` and
`retrieve` (`input_messages` included).

Their requests send no `store`: Llama Stack stores every chat completion, so the server runs with
`--store-chat-completions`. They send no `max_tokens` either; `--override-generation-config` caps the answers and
makes them greedy (the tests check the stored copy, not the text), so a run takes seconds, not minutes.
"""

from __future__ import annotations

import subprocess
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.api.conftest import SERVER_ARGS
from tests.interop.venvs import SERVER, ensure_venv, llama_stack_tests
from tests.support import main_server, server_env

pytestmark = [pytest.mark.slow, pytest.mark.interop, pytest.mark.timeout(3600)]  # a first run builds the venv
STORE_TESTS = 8  # test_inference_store and test_inference_store_tool_calls x (openai, llama-stack client) x stream


@pytest.fixture(scope="module")
def storing_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    workdir = tmp_path_factory.mktemp("storing-server")
    args = [*SERVER_ARGS, "--store-chat-completions", "--store-path", str(workdir / "store.db"),
            "--override-generation-config", '{"temperature": 0, "max_tokens": 96}']  # fmt: skip
    with main_server(workdir, *args) as (url, _log):
        yield url


def test_llama_stack_0_7_3_inference_store_tests_pass(storing_server: str, tmp_path: Path) -> None:
    python, root = ensure_venv(SERVER) / "bin" / "python", llama_stack_tests()
    report = tmp_path / "junit.xml"
    cmd = [str(python), "-m", "pytest", "tests/integration/inference/test_openai_completion.py", "-k",
           "test_inference_store", f"--stack-config={storing_server}", "--text-model=smollm2",
           "--inference-mode=live", "-q", "-p", "no:cacheprovider", f"--junitxml={report}"]  # fmt: skip
    env = server_env("LLAMA_STACK_") | {"HOME": str(tmp_path)}
    done = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=1800)
    output = (done.stdout + done.stderr)[-6000:]
    assert done.returncode == 0, output
    cases = ET.parse(report).getroot().iter("testcase")
    outcomes = {c.get("name"): [child.tag for child in c] for c in cases}
    assert len(outcomes) == STORE_TESTS, (sorted(outcomes), output)
    assert all(not tags for tags in outcomes.values()), (outcomes, output)  # no failure, error or skip
