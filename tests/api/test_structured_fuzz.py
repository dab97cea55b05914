"""Hypothesis fuzz of random JSON schemas through the API (bundled SmolLM2): every answer not cut by `length`
parses and validates against its schema, and every schema the grammar library rejects gets a 400 in the error
envelope (never a 500, never a hang).

Default 60 examples (derandomized: the same ones every run); `PEREGRINE_FUZZ_EXAMPLES=200` for a longer run.
Whether a schema is rejected is decided locally with `engine.sampling.grammar.validate` on a tiny tokenizer (whether a
schema compiles does not depend on the vocabulary); the server must agree.
"""

from __future__ import annotations

import json
import os
from typing import Any

import httpx
import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.sampling import grammar
from engine.types import Constraint

EXAMPLES = int(os.environ.get("PEREGRINE_FUZZ_EXAMPLES", "60"))
NAMES = st.sampled_from(["id", "name", "age", "tags", "ok", "score", "items", "kind", "note", "x"])
PATTERNS = st.sampled_from(["^[a-z]{1,8}$", "^[A-Z][a-z]{0,6}$", "^[0-9]{2,4}$", "^(yes|no)$", "^a+b*$"])


def leaf() -> st.SearchStrategy[dict[str, Any]]:
    return st.one_of(
        st.builds(lambda lo, span: {"type": "integer", "minimum": lo, "maximum": lo + span},
                  st.integers(-50, 50), st.integers(0, 100)),
        st.just({"type": "integer"}),
        st.builds(lambda lo: {"type": "number", "minimum": lo}, st.integers(-10, 10)),
        st.just({"type": "boolean"}),
        st.just({"type": "null"}),
        st.builds(lambda n: {"type": "string", "maxLength": n}, st.integers(1, 12)),
        st.builds(lambda lo, span: {"type": "string", "minLength": lo, "maxLength": lo + span},
                  st.integers(0, 4), st.integers(0, 8)),
        st.builds(lambda p: {"type": "string", "pattern": p}, PATTERNS),
        st.builds(lambda v: {"enum": v}, st.lists(st.one_of(st.integers(-5, 5), st.sampled_from(["a", "b", "cd"]),
                                                            st.booleans()), min_size=1, max_size=4, unique=True)),
        st.builds(lambda v: {"const": v}, st.sampled_from(["fixed", 3, True])),
    )


def compound(children: st.SearchStrategy[dict[str, Any]]) -> st.SearchStrategy[dict[str, Any]]:
    def obj(props: dict[str, Any], required: list[str], closed: bool) -> dict[str, Any]:
        schema: dict[str, Any] = {"type": "object", "properties": props,
                                  "required": [r for r in required if r in props]}
        if closed:
            schema["additionalProperties"] = False
        return schema

    return st.one_of(
        st.builds(obj, st.dictionaries(NAMES, children, min_size=1, max_size=4), st.lists(NAMES, max_size=4),
                  st.just(True)),
        st.builds(obj, st.dictionaries(NAMES, children, max_size=3), st.lists(NAMES, max_size=2), st.booleans()),
        st.builds(lambda items, lo, span: {"type": "array", "items": items, "minItems": lo, "maxItems": lo + span},
                  children, st.integers(0, 2), st.integers(0, 3)),
        st.builds(lambda a, b: {"anyOf": [a, b]}, children, children),
        st.builds(lambda t: {"type": t}, st.just(["string", "integer"])),
    )


def hostile() -> st.SearchStrategy[dict[str, Any]]:
    """Schemas the library should refuse (or that a server must at least survive)."""
    return st.sampled_from([
        {"type": "integer", "minimum": 10, "maximum": 1},
        {"type": "bogus"},
        {"type": "string", "minLength": 5, "maxLength": 2},
        {"allOf": [{"type": "string"}, {"type": "integer"}]},
        {"$ref": "#/$defs/loop", "$defs": {"loop": {"$ref": "#/$defs/loop"}}},
        {"type": "string", "pattern": "(unclosed"},
        {"$ref": "#/$defs/missing"},
        {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
         "additionalProperties": False, "minProperties": 3},
        {"type": "array", "items": {"type": "integer"}, "minItems": 4, "maxItems": 1},
    ])


SCHEMAS = st.one_of(
    st.recursive(leaf(), compound, max_leaves=6).filter(lambda s: len(json.dumps(s)) < 4000),
    hostile(),
)


@pytest.fixture(scope="module")
def tok(byte_level_tokenizer: Any) -> Any:
    return byte_level_tokenizer


def rejected_locally(schema: dict[str, Any], tok: Any) -> bool:
    try:
        grammar.validate(Constraint("json_schema", json.dumps(schema, separators=(",", ":"))), tok)
    except grammar.GrammarError:
        return True
    return False


@settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                 HealthCheck.filter_too_much, HealthCheck.data_too_large])
@given(schema=SCHEMAS, sampled=st.booleans(), field=st.sampled_from(["response_format", "guided_json"]))
def test_random_schemas_validate_or_are_400s(http: httpx.Client, tok: Any, schema: dict[str, Any], sampled: bool,
                                             field: str) -> None:
    body: dict[str, Any] = {
        "messages": [{"role": "user", "content": "Answer with JSON matching this schema: " + json.dumps(schema)}],
        "max_tokens": 48, "temperature": 0.8 if sampled else 0.0, "seed": 1,
    }
    if field == "response_format":
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "fuzz", "schema": schema}}
    else:
        body["guided_json"] = schema
    resp = http.post("/v1/chat/completions", json=body)
    if rejected_locally(schema, tok):
        assert resp.status_code == 400, resp.text
        error = resp.json()["error"]
        assert error["type"] == "invalid_request_error" and error["param"].startswith(field), error
        return
    assert resp.status_code == 200, (schema, resp.text)
    choice = resp.json()["choices"][0]
    if choice["finish_reason"] == "length":
        return  # cut: may be incomplete
    assert choice["finish_reason"] == "stop"
    value = json.loads(choice["message"]["content"])
    jsonschema.validate(value, schema)
