"""models/embedder.py against sentence-transformers' own output for the bundled all-MiniLM-L6-v2."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from models.embedder import Embedder, Pipeline, pool, read_pipeline, resolve_embedding_model

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Peregrine falcons are the fastest birds.",
    "hi",
    "A much longer sentence about embeddings, batching, padding and pooling, " * 30,  # over 256 tokens
    "",
    "Ünïcödé and emoji 🦅 survive tokenization.",
]


def cosine(a: list[float], b: list[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b, strict=True))
    return dot / (math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in b)))


@pytest.fixture(scope="module")
def model_dir() -> Path:
    try:
        path, _ = resolve_embedding_model("bundled:all-minilm-l6-v2")
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    return path


@pytest.fixture(scope="module")
def embedder(model_dir: Path) -> Embedder:
    return Embedder.from_path(model_dir, device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def reference(model_dir: Path):
    st = pytest.importorskip("sentence_transformers")
    model = st.SentenceTransformer(str(model_dir), device="cpu")
    return model.encode(TEXTS, batch_size=4, convert_to_numpy=True)


def test_resolve_bundled_names_the_hub_id(model_dir: Path) -> None:
    path, name = resolve_embedding_model("bundled:all-MiniLM-L6-v2")
    assert path == model_dir and (path / "model.safetensors").exists()
    assert name == "sentence-transformers/all-MiniLM-L6-v2"


def test_resolve_rejects_unknown() -> None:
    with pytest.raises(ValueError, match="unknown bundled"):
        resolve_embedding_model("bundled:nope")
    with pytest.raises(FileNotFoundError):
        resolve_embedding_model("/definitely/not/here")


def test_pipeline_read_from_the_model_folder(model_dir: Path) -> None:
    assert read_pipeline(model_dir) == Pipeline(pooling="mean", normalize=True, max_seq_length=256)


def test_matches_sentence_transformers(embedder: Embedder, reference) -> None:
    ours = embedder.embed(TEXTS)
    assert len(ours) == len(TEXTS)
    for i, (mine, theirs) in enumerate(zip(ours, reference, strict=True)):
        assert len(mine) == 384
        assert cosine(mine, theirs.tolist()) > 0.999, TEXTS[i][:40]
        assert math.isclose(math.sqrt(sum(x * x for x in mine)), 1.0, rel_tol=1e-4)


def test_batched_equals_alone(embedder: Embedder) -> None:
    embedder.max_batch_size = 4  # several batches, each padded differently
    together = embedder.embed(TEXTS)
    alone = [embedder.embed([t])[0] for t in TEXTS]
    for a, b in zip(together, alone, strict=True):
        assert cosine(a, b) > 0.99999


def test_batches_run_per_group_not_per_text(embedder: Embedder, monkeypatch) -> None:
    calls: list[int] = []
    forward = embedder.model.forward

    def counting(*args, **kwargs):
        calls.append(kwargs["input_ids"].shape[0])
        return forward(*args, **kwargs)

    monkeypatch.setattr(embedder.model, "forward", counting)
    embedder.max_batch_size = 4
    embedder.embed(TEXTS)
    assert calls == [4, 2]


def test_dimensions_truncates_and_renormalises(embedder: Embedder) -> None:
    full = embedder.embed(["falcon"])[0]
    short = embedder.embed(["falcon"], dimensions=64)[0]
    assert len(short) == 64
    assert math.isclose(sum(x * x for x in short), 1.0, rel_tol=1e-4)
    assert cosine(short, full[:64]) > 0.9999
    with pytest.raises(ValueError, match="dimensions"):
        embedder.embed(["x"], dimensions=385)


def test_token_counts_include_special_tokens_and_truncation(embedder: Embedder) -> None:
    ids = embedder.tokenizer("hi")["input_ids"]
    assert embedder.count_tokens(["hi"]) == len(ids) == 3  # [CLS] hi [SEP]
    assert embedder.count_tokens([TEXTS[3]]) == 256
    assert embedder.encode(["hi", TEXTS[3]]).prompt_tokens == 259


def test_pooling_modes_respect_the_mask() -> None:
    hidden = torch.tensor([[[1.0, 2.0], [3.0, 4.0], [100.0, 100.0]]])  # [1, 3, 2]; last is padding
    mask = torch.tensor([[1, 1, 0]])
    assert pool(hidden, mask, "mean").tolist() == [[2.0, 3.0]]
    assert pool(hidden, mask, "max").tolist() == [[3.0, 4.0]]
    assert pool(hidden, mask, "cls").tolist() == [[1.0, 2.0]]
    assert pool(hidden, mask, "lasttoken").tolist() == [[3.0, 4.0]]
    assert torch.allclose(pool(hidden, mask, "mean_sqrt_len"), torch.tensor([[4.0, 6.0]]) / math.sqrt(2))


def test_unsupported_module_is_refused(tmp_path: Path) -> None:
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "2_Dense", "type": "sentence_transformers.models.Dense"},
    ]
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(ValueError, match="Dense"):
        read_pipeline(tmp_path)
