"""Fixtures several unit test modules share."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


@pytest.fixture(scope="module")
def tokenizer(byte_level_tokenizer: Any, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The byte-level test tokenizer, saved and loaded back the way scripts/bench*.py load a model's."""
    if str(SCRIPTS) not in sys.path:
        sys.path.insert(0, str(SCRIPTS))
    from bench_datasets import load_tokenizer

    folder = tmp_path_factory.mktemp("tok")
    byte_level_tokenizer.save_pretrained(folder)
    return load_tokenizer(folder)
