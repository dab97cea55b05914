"""The real llama-stack-client, modern (0.7.x, Python 3.12) and legacy (0.2.x, Python 3.11), against a real
Peregrine server. Each runs from its own virtual environment, built from the package registry on first use
and cached (tests/interop/venvs.py); the driver scripts (tests/interop/lsc_*.py) print what the client saw
and the assertions are made here.
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.interop.harness import check_embeddings, check_generation, cosine, direct, embedding_id, run_client
from tests.interop.venvs import CLIENT_LEGACY, CLIENT_MODERN, CLIENT_NO_DONE

# A first run builds the clients' (and the stack's) venvs inside setup: allow for it beyond the default 900 s.
pytestmark = [pytest.mark.slow, pytest.mark.interop, pytest.mark.timeout(3600)]
__all__ = ["direct", "embedding_id"]  # fixtures, imported so pytest finds them here


def test_modern_client(server: str, model_id: str, embedding_id: str, direct: dict[str, Any]) -> None:
    parts = "inspect,models,chat,completions,embeddings,forced_done"
    seen = run_client(CLIENT_MODERN, "lsc_modern.py", server, model_id, embedding_id, parts)
    assert seen["client_version"].startswith("0.7.")
    assert (seen["health"], seen["version"]) == ("OK", httpx.get(f"{server}/v1/version").json()["version"])
    assert seen["models"][model_id]["model_type"] == "llm"
    assert seen["models"][embedding_id]["model_type"] == "embedding"
    assert seen["models"][embedding_id]["metadata"]["embedding_dimension"] == 384
    assert seen["retrieve_llm"] == {"identifier": model_id, "model_type": "llm", "provider_id": "peregrine",
                                    "provider_resource_id": model_id}  # fmt: skip
    assert seen["retrieve_embedding"]["model_type"] == "embedding"
    check_generation(seen, direct)
    check_embeddings(seen, direct)
    assert seen["forced_done_error"] is None and seen["forced_done_deltas"] > 0


def test_client_that_crashes_on_done_is_spared(
    server: str, model_id: str, embedding_id: str, direct: dict
) -> None:
    """llama-stack-client 0.6.0 parses `[DONE]` as JSON. By default it gets no `[DONE]` and streams fine;
    with `[DONE]` forced on for one request it fails, which is why the rule exists."""
    seen = run_client(
        CLIENT_NO_DONE, "lsc_modern.py", server, model_id, embedding_id, "chat,completions,forced_done"
    )
    assert seen["client_version"] == "0.6.0"
    check_generation(seen, direct)
    assert seen["forced_done_error"] is not None


def test_legacy_client_native_inference(server: str, model_id: str, embedding_id: str, direct: dict) -> None:
    seen = run_client(CLIENT_LEGACY, "lsc_legacy.py", server, model_id, embedding_id)
    assert seen["client_version"].startswith("0.2.")
    assert seen["models"] == {model_id: "llm", embedding_id: "embedding"}  # the native list shape
    chat = seen["chat"]
    assert (chat["role"], chat["content"], chat["stop_reason"]) == (
        "assistant",
        direct["chat"],
        "out_of_tokens",
    )
    assert len(chat["logprobs"]) == 8 and all(1 <= len(lp) <= 3 for lp in chat["logprobs"])
    assert chat["metrics"]["completion_tokens"] == 8
    stream = seen["chat_stream"]
    assert stream["event_types"][0] == "start" and stream["event_types"][-1] == "complete"
    assert stream["text"] == direct["chat"] and stream["delta_types"] == ["text"]
    assert stream["stop_reasons"] == ["out_of_tokens"]
    assert seen["chat_sampled_stop_reason"] in ("out_of_tokens", "end_of_turn")
    assert seen["chat_after_tool"]
    # 8 greedy tokens of the same prompt extend the OpenAI route's 6
    assert seen["completion"]["content"].startswith(direct["completion"])
    assert seen["completion_stream"]["text"] == seen["completion"]["content"]
    assert seen["completion_stream"]["stop_reasons"] == ["out_of_tokens"]
    for got, expected in zip(seen["embeddings"], direct["embeddings"], strict=True):
        assert cosine(got, expected) > 0.99999
    assert len(seen["embeddings_32"][0]) == 32
