"""The run config docs/llama-stack.md shows is the one the Llama Stack interop test runs."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]


def test_docs_run_yaml_is_the_tested_example() -> None:
    page = (REPO / "docs" / "llama-stack.md").read_text()
    section = page[page.index("## Peregrine as a Llama Stack provider") :]
    shown = re.search(r"```yaml\n(.*?)```", section, re.S)
    assert shown is not None
    example = yaml.safe_load((REPO / "examples" / "llama-stack-run.yaml").read_text())
    assert yaml.safe_load(shown.group(1)) == example
    assert example["providers"]["inference"][0]["provider_type"] == "remote::vllm"
