"""Model sources and Hub downloads, against a local stand-in for the Hub's HTTP API (never the real Hub).

`FakeHub` is a small http.server on 127.0.0.1 that answers the calls huggingface_hub makes:
  GET  /api/models/{repo}/revision/{rev}        model_info / repo_info (siblings with sizes, safetensors)
  GET  /api/models/{repo}/tree/{rev}             list_repo_tree (snapshot_download's file list)
  HEAD /{repo}/resolve/{rev}/{file}              file metadata (commit, etag, size)
  GET  /{repo}/resolve/{rev}/{file}              the bytes
Gated repos answer 401 + X-Error-Code: GatedRepo without the right bearer token; unknown repos 404 +
RepoNotFound. Every request is recorded, so tests can check what was fetched.
"""

from __future__ import annotations

import hashlib
import json
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlparse

import pytest

from models import hub
from models.hub import HubError, ModelSource

COMMIT = "0123456789abcdef0123456789abcdef01234567"
TOKEN = "hf_test_token"


@dataclass
class Repo:
    files: dict[str, bytes]
    gated: bool = False
    params: int | None = None


@dataclass
class FakeHub:
    repos: dict[str, Repo]
    requests: list[tuple[str, str]] = field(default_factory=list)
    url: str = ""

    def downloaded(self) -> set[str]:
        return {
            p.rsplit(f"/resolve/{COMMIT}/", 1)[-1]
            for m, p in self.requests
            if m == "GET" and "/resolve/" in p
        }


def make_handler(state: FakeHub) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:  # keep pytest output clean
            pass

        def do_HEAD(self) -> None:
            self.answer(body=False)

        def do_GET(self) -> None:
            self.answer(body=True)

        def answer(self, body: bool) -> None:
            path = unquote(urlparse(self.path).path)
            state.requests.append((self.command, path))
            if path.startswith("/api/models/"):
                return self.api(path.removeprefix("/api/models/"))
            if "/resolve/" in path:
                repo_id, _, rest = path.lstrip("/").partition("/resolve/")
                _rev, _, filename = rest.partition("/")
                return self.resolve(repo_id, filename, body)
            self.fail(404, "EntryNotFound")

        def api(self, rest: str) -> None:
            for kind in ("/revision/", "/tree/"):
                if kind in rest:
                    repo_id, _, _rev = rest.partition(kind)
                    repo = self.repo(repo_id)
                    if repo is None:
                        return
                    data = self.info(repo_id, repo) if kind == "/revision/" else self.tree(repo)
                    return self.send_json(data)
            self.fail(404, "EntryNotFound")

        def repo(self, repo_id: str) -> Repo | None:
            repo = state.repos.get(repo_id)
            if repo is None:
                self.fail(404, "RepoNotFound")
            elif repo.gated and self.headers.get("Authorization") != f"Bearer {TOKEN}":
                self.fail(401, "GatedRepo")
                return None
            return repo

        def info(self, repo_id: str, repo: Repo) -> dict:
            siblings = [{"rfilename": n, "size": len(b), "blobId": _sha1(b)} for n, b in repo.files.items()]
            data = {"id": repo_id, "modelId": repo_id, "sha": COMMIT, "private": False, "siblings": siblings}
            if repo.params is not None:
                data["safetensors"] = {"parameters": {"BF16": repo.params}, "total": repo.params}
            return data

        def tree(self, repo: Repo) -> list:
            return [
                {"type": "file", "path": n, "size": len(b), "oid": _sha1(b)} for n, b in repo.files.items()
            ]

        def resolve(self, repo_id: str, filename: str, body: bool) -> None:
            repo = self.repo(repo_id)
            if repo is None:
                return
            if filename not in repo.files:
                return self.fail(404, "EntryNotFound")
            data = repo.files[filename]
            self.send_response(200)
            self.send_header("X-Repo-Commit", COMMIT)
            self.send_header("ETag", f'"{_sha1(data)}"')
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if body:
                self.wfile.write(data)

        def send_json(self, data: object) -> None:
            payload = json.dumps(data).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(payload)

        def fail(self, status: int, code: str) -> None:
            payload = json.dumps({"error": code}).encode()
            self.send_response(status)
            self.send_header("X-Error-Code", code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(payload)

    return Handler


def _sha1(data: bytes) -> str:
    return hashlib.sha1(data).hexdigest()


CONFIG = json.dumps({"model_type": "llama", "num_hidden_layers": 2, "num_attention_heads": 2, "hidden_size": 8,
                     "max_position_embeddings": 64}).encode()  # fmt: skip


def model_repo(**extra: bytes) -> dict[str, bytes]:
    files = {
        "config.json": CONFIG,
        "generation_config.json": b'{"do_sample": false}',
        "tokenizer.json": b'{"version": "1.0"}',
        "tokenizer_config.json": b'{"model_max_length": 64}',
        "model-00001-of-00002.safetensors": b"w" * 3000,
        "model-00002-of-00002.safetensors": b"v" * 1000,
        "model.safetensors.index.json": b'{"weight_map": {}}',  # distinct bytes: the cache dedups blobs
        "README.md": b"# model card",
        "original/consolidated.00.pth": b"p" * 5000,
        "pytorch_model.bin": b"b" * 4000,
        "onnx/model.onnx": b"o" * 100,
    }
    return files | extra


@pytest.fixture
def fake_hub() -> Iterator[FakeHub]:
    state = FakeHub(
        repos={
            "org/model": Repo(model_repo(), params=2000),
            "org/gated": Repo(model_repo(), gated=True),
            "org/binonly": Repo({"config.json": CONFIG, "pytorch_model.bin": b"b" * 10}),
            "org/noweights": Repo({"config.json": CONFIG, "README.md": b"x"}),
        }
    )
    with serving(state):
        yield state


@contextmanager
def serving(state: FakeHub) -> Iterator[FakeHub]:
    """The stand-in Hub on a free loopback port (its URL in `state.url`) while the block runs."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), make_handler(state))
    state.url = f"http://127.0.0.1:{server.server_address[1]}"
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield state
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def hf_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    return tmp_path / "hf-cache"


def closed_port_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"  # nothing listens once the socket is closed


# --- naming the source --------------------------------------------------------------------------------


def test_select_files_keeps_only_what_serving_needs() -> None:
    names = list(model_repo())
    assert hub.select_files(names) == [
        "config.json",
        "generation_config.json",
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
        "model.safetensors.index.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ]


def test_select_files_falls_back_to_bin_and_remote_code() -> None:
    names = ["config.json", "pytorch_model.bin", "modeling_x.py", "tokenizer.model", "chat_template.jinja"]
    assert hub.select_files(names) == [
        "chat_template.jinja",
        "config.json",
        "pytorch_model.bin",
        "tokenizer.model",
    ]
    assert "modeling_x.py" in hub.select_files(names, trust_remote_code=True)


# --- the Hub --------------------------------------------------------------------------------------------


def test_plan_lists_needed_files_with_sizes(fake_hub: FakeHub, hf_cache: Path) -> None:
    plan = hub.plan_download(
        ModelSource("hub", repo_id="org/model"), download_dir=hf_cache, endpoint=fake_hub.url
    )
    assert (plan.revision, plan.commit) == ("main", COMMIT)
    assert set(plan.files) == set(hub.select_files(list(model_repo())))
    assert plan.files["model-00001-of-00002.safetensors"] == 3000
    assert plan.missing == plan.files and plan.missing_bytes == sum(plan.files.values())
    assert plan.param_count == 2000


def test_download_fetches_only_the_planned_files_then_reuses_the_cache(
    fake_hub: FakeHub, hf_cache: Path
) -> None:
    source = ModelSource("hub", repo_id="org/model")
    plan = hub.plan_download(source, download_dir=hf_cache, endpoint=fake_hub.url)
    folder = hub.download(plan, download_dir=hf_cache, endpoint=fake_hub.url)
    assert sorted(p.name for p in folder.iterdir()) == sorted(plan.files)
    assert (folder / "model-00002-of-00002.safetensors").read_bytes() == b"v" * 1000
    assert fake_hub.downloaded() == set(plan.files)  # no README, no .bin, no original/ or onnx/

    fake_hub.requests.clear()
    again = hub.plan_download(source, download_dir=hf_cache, endpoint=fake_hub.url)
    assert again.missing == {}  # everything is cached now
    assert hub.download(again, download_dir=hf_cache, endpoint=fake_hub.url) == folder
    assert fake_hub.downloaded() == set()


def test_partial_cache_downloads_only_the_rest(fake_hub: FakeHub, hf_cache: Path) -> None:
    from huggingface_hub import hf_hub_download

    hf_hub_download("org/model", "config.json", cache_dir=hf_cache, endpoint=fake_hub.url)
    plan = hub.plan_download(
        ModelSource("hub", repo_id="org/model"), download_dir=hf_cache, endpoint=fake_hub.url
    )
    assert "config.json" not in plan.missing and "config.json" in plan.files
    assert plan.missing_bytes == sum(plan.files.values()) - len(CONFIG)


def test_fetch_config(fake_hub: FakeHub, hf_cache: Path) -> None:
    plan = hub.plan_download(
        ModelSource("hub", repo_id="org/model"), download_dir=hf_cache, endpoint=fake_hub.url
    )
    assert hub.fetch_config(plan, download_dir=hf_cache, endpoint=fake_hub.url)["num_hidden_layers"] == 2


def test_bin_only_repo_downloads_the_bin(fake_hub: FakeHub, hf_cache: Path) -> None:
    plan = hub.plan_download(
        ModelSource("hub", repo_id="org/binonly"), download_dir=hf_cache, endpoint=fake_hub.url
    )
    assert set(plan.files) == {"config.json", "pytorch_model.bin"} and plan.param_count is None


def test_repo_without_weights_is_refused(fake_hub: FakeHub, hf_cache: Path) -> None:
    with pytest.raises(HubError, match="no safetensors or PyTorch weights"):
        hub.plan_download(
            ModelSource("hub", repo_id="org/noweights"), download_dir=hf_cache, endpoint=fake_hub.url
        )


def test_gated_repo_needs_the_token(fake_hub: FakeHub, hf_cache: Path) -> None:
    source = ModelSource("hub", repo_id="org/gated")
    with pytest.raises(HubError, match=r"org/gated is gated: .*HF_TOKEN"):
        hub.plan_download(source, download_dir=hf_cache, endpoint=fake_hub.url)
    plan = hub.plan_download(source, token=TOKEN, download_dir=hf_cache, endpoint=fake_hub.url)
    folder = hub.download(plan, token=TOKEN, download_dir=hf_cache, endpoint=fake_hub.url)
    assert (folder / "config.json").read_bytes() == CONFIG


def test_unknown_repo(fake_hub: FakeHub, hf_cache: Path) -> None:
    with pytest.raises(HubError, match="org/missing was not found on the Hub"):
        hub.plan_download(
            ModelSource("hub", repo_id="org/missing"), download_dir=hf_cache, endpoint=fake_hub.url
        )


def test_unreachable_hub_and_not_cached_is_one_clear_error(hf_cache: Path) -> None:
    with pytest.raises(HubError) as info:
        hub.plan_download(
            ModelSource("hub", repo_id="org/model"), download_dir=hf_cache, endpoint=closed_port_url()
        )
    message = str(info.value)
    assert message.startswith("org/model is not in the local model cache and the Hub cannot be reached")
    assert "\n" not in message


def test_unreachable_hub_with_the_model_cached_serves_from_cache(fake_hub: FakeHub, hf_cache: Path) -> None:
    source = ModelSource("hub", repo_id="org/model")
    plan = hub.plan_download(source, download_dir=hf_cache, endpoint=fake_hub.url)
    folder = hub.download(plan, download_dir=hf_cache, endpoint=fake_hub.url)

    offline_url = closed_port_url()
    offline = hub.plan_download(source, download_dir=hf_cache, endpoint=offline_url)
    assert offline.missing == {} and set(offline.files) == set(plan.files)
    assert hub.download(offline, download_dir=hf_cache, endpoint=offline_url) == folder
    assert hub.fetch_config(offline, download_dir=hf_cache, endpoint=offline_url)["hidden_size"] == 8


def test_offline_mode_uses_the_cache(
    fake_hub: FakeHub, hf_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from huggingface_hub import constants

    source = ModelSource("hub", repo_id="org/model")
    hub.download(hub.plan_download(source, download_dir=hf_cache, endpoint=fake_hub.url), download_dir=hf_cache,
                 endpoint=fake_hub.url)  # fmt: skip
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    fake_hub.requests.clear()
    plan = hub.plan_download(source, download_dir=hf_cache, endpoint=fake_hub.url)
    assert plan.missing == {} and fake_hub.requests == []  # offline: not one request
    with pytest.raises(HubError, match=r"org/binonly is not in the local model cache and offline mode is on"):
        hub.plan_download(
            ModelSource("hub", repo_id="org/binonly"), download_dir=hf_cache, endpoint=fake_hub.url
        )


def test_main_offline_and_not_cached_is_one_clean_line(tmp_path: Path) -> None:
    """End to end through main.py: exit 1 with the reason, no traceback."""
    import os
    import subprocess
    import sys

    repo = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if not k.startswith("PEREGRINE_")} | {"HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, str(repo / "main.py"), "--model", "org/never-downloaded", "--device", "cpu",
           "--dtype", "float32", "--download-dir", str(tmp_path / "hf")]  # fmt: skip
    result = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 1
    assert "org/never-downloaded is not in the local model cache and offline mode is on" in result.stderr
    assert "Traceback" not in result.stderr
