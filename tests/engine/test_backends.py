"""Device backends (engine/backends/): one registry, one backend per kind with every method of the interface,
measured free memory, clear errors when a device is missing, and `--device tt` starting and answering a request on
a fake Tenstorrent device (tests/fake_tt: stand-ins for `ttnn` and `torch_ttnn`, because no Tenstorrent card is
here; its torch.compile backend runs the graphs on the CPU)."""

from __future__ import annotations

import copy
import importlib.util
import inspect
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from config import tool_cache_dir
from engine.backends import BACKENDS, Backend, devices
from engine.backends.cpu import CpuBackend
from engine.backends.cuda import CudaBackend
from engine.backends.devices import backend_for
from engine.backends.kernels import TORCH, KernelOptions
from engine.types import EngineConfig, SamplingParams
from tests.support import Loaded, hf_greedy, make_engine, run_all, tokens_of

FAKE_TT = Path(__file__).resolve().parents[1] / "fake_tt"


def config(device: str, **kw: Any) -> EngineConfig:
    return EngineConfig(model_path="in-memory", model_name="test", device=device, **kw)


def test_cpu_backend_measures_free_memory() -> None:
    backend = backend_for(config("cpu"), torch.device("cpu"))
    assert backend.name == "cpu" and backend.free_memory_bytes() > 0
    model = torch.nn.Linear(2, 2)
    assert backend.prepare(model, TORCH) is model and backend.serves_quantized


def test_one_registry_and_unknown_device() -> None:
    assert set(BACKENDS) == {"cpu", "cuda", "tt"} and devices.PROBES["tt"] is BACKENDS["tt"].probe
    assert backend_for(config("auto"), torch.device("cpu")).name == "cpu"  # an unresolved config: by the torch device
    with pytest.raises(devices.DeviceError, match="unknown device"):
        backend_for(config("mps"), torch.device("cpu"))


def interface(cls: type) -> set[str]:
    return {name for name, _ in inspect.getmembers(cls, callable) if not name.startswith("_")}


@pytest.mark.parametrize("kind", sorted(BACKENDS))
def test_every_backend_has_every_method_of_the_interface(kind: str) -> None:
    """A backend missing a method (as TTBackend once lacked `kernels`, so `--device tt` could not start) fails
    here, before any device is needed."""
    cls = BACKENDS[kind].backend
    assert isinstance(cls, type)
    missing = interface(Backend) - interface(cls)
    assert not missing, f"{cls.__name__} lacks {sorted(missing)}"
    assert {"name", "serves_quantized"} <= set(vars(cls))


def test_devices_without_kernels_of_their_own_compute_with_torch() -> None:
    """CUDA's kernel set is torch's whatever --cpu-kernels says (built without a GPU: only its choices are read)."""
    cuda = object.__new__(CudaBackend)
    cuda.device = torch.device("cuda", 1)
    assert cuda.kernels(torch.bfloat16) is TORCH and not cuda.serves_quantized and not cuda.team_fills_cpus()
    assert cuda.load_kwargs() == {"device_map": {"": "cuda:1"}}  # weights read straight onto the GPU
    off = CpuBackend(torch.device("cpu"), KernelOptions(False, None))
    assert off.kernels(torch.bfloat16).path == "torch" and off.kernels(torch.bfloat16).quant is None


def test_resolved_names_are_translated_not_probed() -> None:
    assert devices.kind_of("cuda:1") == "cuda" and devices.kind_of("tt") == "tt"
    assert devices.cuda_index("cuda") == 0 and devices.cuda_index("cuda:2") == 2 and devices.cuda_index("tt") is None
    assert devices.placement("cpu", "bfloat16") == (torch.device("cpu"), torch.bfloat16)
    assert devices.placement("tt", "bfloat16")[0] == torch.device("cpu")  # host tensors; the card runs graphs
    assert devices.resolve("cpu", "auto") == devices.Resolved("cpu", "auto")  # the CPU's auto: timed when loaded
    assert devices.aux_device("tt") == torch.device("cpu") and devices.aux_device("cuda:1") == torch.device("cuda:1")


def test_the_isa_cap_is_a_config_field_the_backend_honours() -> None:
    backend = backend_for(config("cpu", cpu_isa="none", cache_dir=str(tool_cache_dir())), torch.device("cpu"))
    assert backend.kernels(torch.float32).path == "torch"  # every level hidden: torch's ops
    with pytest.raises(ValueError, match="sse9"):
        backend_for(config("cpu", cpu_isa="sse9"), torch.device("cpu"))


@pytest.mark.skipif(importlib.util.find_spec("torch_ttnn") is not None, reason="torch-ttnn is installed here")
def test_tt_without_torch_ttnn_says_what_is_missing() -> None:
    with pytest.raises(RuntimeError, match=r"torch_ttnn.*not installed.*peregrine\[tt\]"):
        backend_for(config("tt"), torch.device("cpu"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is visible here")
def test_cuda_without_a_gpu_is_a_clear_error() -> None:
    with pytest.raises(RuntimeError, match="cuda"):
        backend_for(config("cuda"), torch.device("cuda"))


# --- a fake Tenstorrent device -------------------------------------------------------------------------


@pytest.fixture
def fake_tt(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Any, Any]]:
    """The stand-in `ttnn` and `torch_ttnn` (tests/fake_tt), importable for this test only."""
    monkeypatch.syspath_prepend(str(FAKE_TT))
    for name in ("ttnn", "torch_ttnn"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    import torch_ttnn
    import ttnn

    yield ttnn, torch_ttnn
    if "torch._dynamo" in sys.modules:
        torch._dynamo.reset()  # the compiled graphs hold the test's model


def test_tt_resolves_on_the_fake_device(fake_tt: tuple[Any, Any]) -> None:
    assert devices.resolve("tt", "auto") == devices.Resolved("tt", "bfloat16")


def test_an_engine_starts_on_tt_and_answers_through_the_compiled_graph(fake_tt: tuple[Any, Any],
                                                                       tiny: Loaded) -> None:
    """`--device tt`'s start: the TT backend's kernels (torch's), its forward (the generic one, compiled with
    torch_ttnn's backend), then one greedy request, whose tokens are transformers' own."""
    ttnn, torch_ttnn = fake_tt
    model = copy.deepcopy(tiny.model)
    engine = make_engine(Loaded(model, tiny.tokenizer, tiny.max_model_len), device="tt")
    assert engine.backend.name == "tt" and engine.kernels is TORCH and engine.runner.impl == "generic"
    assert len(ttnn.opened) == 1
    prompt = tiny.tokenizer.encode("Hello world")
    out = run_all(engine, {"r": (prompt, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))})
    assert tokens_of(out["r"]) == hf_greedy(tiny.model, prompt, 6)
    assert torch_ttnn.compiled, "the forward did not go through torch_ttnn's backend"


@pytest.mark.slow
def test_main_py_starts_with_device_tt_and_answers_a_chat_request(tiny_model_dir: Any, tmp_path: Path) -> None:
    """`python main.py --device tt` as a user starts it, with the fake ttnn / torch_ttnn on its PYTHONPATH (no
    Tenstorrent card is here): ready, then one chat completion through the real OpenAI SDK."""
    import subprocess

    import openai

    from tests.support import free_port, server_env, stop_process, wait_http_ok

    port = free_port()
    env = server_env() | {"PYTHONPATH": str(FAKE_TT)}
    cmd = [sys.executable, str(Path(__file__).resolve().parents[2] / "main.py"), "--model", str(tiny_model_dir.path),
           "--host", "127.0.0.1", "--port", str(port), "--device", "tt", "--dtype", "float32",
           "--embedding-model", "none", "--skip-preflight", "--served-model-name", "tiny"]  # fmt: skip
    log_path = tmp_path / "server.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_http_ok(f"http://127.0.0.1:{port}/ready", proc, log_path, 600.0)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=600)
        chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}],
                                              max_tokens=4, temperature=0, extra_body={"ignore_eos": True})
        assert chat.choices[0].finish_reason == "length" and chat.usage.completion_tokens == 4
        assert "forward pass: generic" in log_path.read_text(errors="replace")  # the TT backend's forward
    finally:
        stop_process(proc)
