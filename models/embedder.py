"""Sentence embeddings served beside the LLM: a Hugging Face encoder plus the pooling its folder declares.

A sentence-transformers model folder describes its pipeline in `modules.json`: a Transformer, then a
Pooling module (`1_Pooling/config.json` says which pooling), then optionally Normalize. We run that
pipeline with `transformers.AutoModel` and our own pooling, so sentence-transformers is not needed at run
time; the tests compare our vectors with its output. A plain Hugging Face folder without `modules.json`
gets mean pooling and L2 normalisation, the sentence-transformers defaults.

`embed` takes a whole request's texts and runs them in padded batches (sorted by length so each batch
pads little), never one text at a time. `dimensions` keeps the first N components and re-normalises
(Matryoshka truncation, what the OpenAI API's `dimensions` means).
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from engine.backends import devices
from models import hub

PoolingMode = Literal["cls", "mean", "max", "mean_sqrt_len", "lasttoken"]

_TRANSFORMER = "sentence_transformers.models.Transformer"
_POOLING = "sentence_transformers.models.Pooling"
_NORMALIZE = "sentence_transformers.models.Normalize"


@dataclass(frozen=True, slots=True)
class Pipeline:
    """What a model folder says to do after the encoder."""

    pooling: PoolingMode = "mean"
    normalize: bool = True
    max_seq_length: int | None = None
    do_lower_case: bool = False


@dataclass(frozen=True, slots=True)
class EmbeddingResult:
    vectors: list[list[float]]
    prompt_tokens: int  # tokens the encoder saw, summed over the inputs (after truncation)


def resolve_embedding_model(spec: str) -> tuple[Path, str]:
    """Turn the `embedding_model` setting into (local folder, served name).

    `bundled:<name>` is a model shipped in a Python package (found without importing it); anything else
    is a local folder, served under its folder name.
    """
    if spec.startswith("bundled:"):
        name = spec.removeprefix("bundled:").lower()
        known = [n for n, b in hub.BUNDLED.items() if b.task == "embed"]
        if name not in known:
            raise ValueError(f"unknown bundled embedding model {name!r}; known: {', '.join(known)}")
        try:
            return hub.bundled_path(name), hub.BUNDLED[name].hub_id
        except hub.HubError as exc:
            raise FileNotFoundError(str(exc)) from None
    path = Path(spec).expanduser()
    if not path.is_dir():
        raise FileNotFoundError(f"embedding model folder not found: {path}")
    return path, path.name


EMBED_SUFFIX = "-embed"


def discoverable_name(name: str) -> str:
    """The default served id: `name`, plus "-embed" unless it says "embed" already. Llama Stack's remote::vllm
    provider (and other vLLM clients) tell embedding models from LLMs in /v1/models by that word alone."""
    return name if "embed" in name.lower() else name + EMBED_SUFFIX


def read_pipeline(path: Path) -> Pipeline:
    """Read modules.json and the pooling / sentence-bert configs; refuse modules we do not implement."""
    modules_file = path / "modules.json"
    if not modules_file.exists():
        return Pipeline(**_sbert_config(path))
    pooling: PoolingMode | None = None
    normalize = False
    for module in json.loads(modules_file.read_text()):
        kind = module["type"]
        if kind == _POOLING:
            pooling = _pooling_mode(json.loads((path / module["path"] / "config.json").read_text()))
        elif kind == _NORMALIZE:
            normalize = True
        elif kind != _TRANSFORMER:
            raise ValueError(f"{path}: sentence-transformers module {kind} is not supported")
    return Pipeline(pooling=pooling or "mean", normalize=normalize, **_sbert_config(path))


def _sbert_config(path: Path) -> dict:
    file = path / "sentence_bert_config.json"
    cfg = json.loads(file.read_text()) if file.exists() else {}
    return {"max_seq_length": cfg.get("max_seq_length"), "do_lower_case": bool(cfg.get("do_lower_case"))}


_POOLING_KEYS: dict[str, PoolingMode] = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len",
    "pooling_mode_lasttoken": "lasttoken",
}


def _pooling_mode(cfg: dict) -> PoolingMode:
    """The one pooling mode a 1_Pooling/config.json enables (sentence-transformers can concatenate several)."""
    chosen = [mode for key, mode in _POOLING_KEYS.items() if cfg.get(key)]
    unsupported = [k for k in cfg if k.startswith("pooling_mode_") and k not in _POOLING_KEYS and cfg[k]]
    if len(chosen) != 1 or unsupported:
        raise ValueError(
            f"exactly one supported pooling mode is needed, the config enables {chosen + unsupported}"
        )
    return chosen[0]


def pool(hidden: torch.Tensor, mask: torch.Tensor, mode: PoolingMode) -> torch.Tensor:
    """hidden [batch, seq, dim], mask [batch, seq] (1 = real token, right padding) -> [batch, dim]."""
    m = mask.unsqueeze(-1).to(hidden.dtype)  # [batch, seq, 1]
    if mode == "cls":
        return hidden[:, 0]
    if mode == "max":
        return hidden.masked_fill(m == 0, torch.finfo(hidden.dtype).min).max(dim=1).values
    if mode == "lasttoken":
        last = mask.sum(dim=1) - 1  # [batch]
        return hidden[torch.arange(hidden.shape[0], device=hidden.device), last]
    summed = (hidden * m).sum(dim=1)
    counts = m.sum(dim=1).clamp(min=1e-9)  # [batch, 1]
    return summed / (counts if mode == "mean" else counts.sqrt())


class Embedder:
    """A loaded embedding model. Thread-safe: one batch runs at a time."""

    def __init__(
        self, model, tokenizer, pipeline: Pipeline, name: str, device: torch.device, max_batch_size: int = 32
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.pipeline = pipeline
        self.name = name
        self.device = device
        self.max_batch_size = max_batch_size
        self.dimension: int = model.config.hidden_size
        limits = [
            n for n in (pipeline.max_seq_length, getattr(model.config, "max_position_embeddings", None)) if n
        ]
        self.max_seq_length: int = min(limits) if limits else 512
        self._lock = threading.Lock()

    @classmethod
    def from_path(
        cls, path: str | Path, device: str = "cpu", dtype: str = "float32", name: str | None = None
    ) -> Embedder:
        from transformers import AutoModel, AutoTokenizer

        path = Path(path)
        torch_device = devices.aux_device(device)  # the backend's choice: a CUDA device's own, else the host
        torch_dtype = torch.float32 if dtype == "auto" else getattr(torch, dtype)
        model = AutoModel.from_pretrained(str(path), dtype=torch_dtype).to(torch_device).eval()
        tokenizer = AutoTokenizer.from_pretrained(str(path))
        return cls(model, tokenizer, read_pipeline(path), name or path.name, torch_device)

    def embed(self, texts: list[str], dimensions: int | None = None) -> list[list[float]]:
        return self.encode(texts, dimensions).vectors

    def count_tokens(self, texts: list[str]) -> int:
        return sum(self.token_counts(texts))

    def token_counts(self, texts: list[str], truncate: bool = True) -> list[int]:
        """Tokens per text, special tokens included; `truncate=False` gives the full length."""
        if truncate:
            return [len(ids) for ids in self._tokenize(texts, pad=False)["input_ids"]]
        return [len(ids) for ids in self.tokenizer(self._case(texts))["input_ids"]]

    def encode(self, texts: list[str], dimensions: int | None = None) -> EmbeddingResult:
        """Embed `texts` in length-sorted padded batches; the result keeps the input order."""
        if dimensions is not None and not 0 < dimensions <= self.dimension:
            raise ValueError(f"dimensions must be between 1 and {self.dimension}, got {dimensions}")
        order = sorted(range(len(texts)), key=lambda i: -len(texts[i]))
        vectors: list[list[float]] = [[] for _ in texts]
        tokens = 0
        for start in range(0, len(order), self.max_batch_size):
            batch = order[start : start + self.max_batch_size]
            pooled, batch_tokens = self._embed_batch([texts[i] for i in batch], dimensions)
            tokens += batch_tokens
            for i, row in zip(batch, pooled.tolist(), strict=True):
                vectors[i] = row
        return EmbeddingResult(vectors, tokens)

    def _embed_batch(self, texts: list[str], dimensions: int | None) -> tuple[torch.Tensor, int]:
        encoded = self._tokenize(texts, pad=True).to(self.device)
        with self._lock, torch.inference_mode():
            hidden = self.model(**encoded).last_hidden_state  # [batch, seq, dim]
            pooled = pool(hidden, encoded["attention_mask"], self.pipeline.pooling).float()  # [batch, dim]
            if self.pipeline.normalize:
                pooled = torch.nn.functional.normalize(pooled, p=2, dim=1)
            if dimensions is not None and dimensions < self.dimension:
                pooled = torch.nn.functional.normalize(pooled[:, :dimensions], p=2, dim=1)
        return pooled.cpu(), int(encoded["attention_mask"].sum())

    def _case(self, texts: list[str]) -> list[str]:
        return [t.lower() for t in texts] if self.pipeline.do_lower_case else texts

    def _tokenize(self, texts: list[str], pad: bool):
        return self.tokenizer(
            self._case(texts),
            padding=pad,
            truncation=True,
            max_length=self.max_seq_length,
            return_tensors="pt" if pad else None,
        )
