"""Structured output on the wire: the request fields that constrain the answer -> one engine `Constraint`.

| field (chat and completions)                  | constraint                                     |
|-----------------------------------------------|------------------------------------------------|
| `response_format: {"type": "text"}`            | none                                           |
| `response_format: {"type": "json_object"}`     | any JSON object (llama.cpp's `schema` inside: that schema) |
| `response_format: {"type": "json_schema", "json_schema": {"name", "schema", "strict"}}` | the schema |
| `structured_outputs` (vLLM): one of `json`, `regex`, `choice`, `grammar`, `json_object` | that one |
| `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar` (vLLM, older) | the same |
| `grammar` (llama.cpp: GBNF; Lark is accepted too), `json_schema` (llama.cpp) | the grammar / schema |

At most one of them per request (`response_format: text` does not count); two -> 400 naming the second.
An unknown `response_format.type` or `structured_outputs` key, a schema or grammar the grammar library
rejects, or one too large or too slow to compile -> 400 naming the field (`check`, before the request is
queued, compiling off the event loop; the compiled grammar is cached for the engine).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from app.errors import BadRequestError
from engine.sampling import grammar
from engine.types import Constraint

FIELDS = ("response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
          "grammar", "json_schema")
STRUCTURED_OUTPUT_KEYS = ("json", "regex", "choice", "grammar", "json_object")
# vLLM's structured_outputs options that do not change which answers are valid (whitespace is always compact)
STRUCTURED_OUTPUT_OPTIONS = ("disable_fallback", "disable_any_whitespace", "disable_additional_properties",
                             "whitespace_pattern", "backend")


def given(req: Any) -> list[str]:
    """The structured output fields the request sets (`response_format: text` is no constraint)."""
    out = []
    for name in FIELDS:
        value = getattr(req, name, None)
        if value is None:
            continue
        if name == "response_format" and isinstance(value, dict) and value.get("type") == "text":
            continue
        out.append(name)
    return out


def field_of(req: Any) -> str | None:
    names = given(req)
    return names[0] if names else None


def constraint_of(req: Any) -> Constraint | None:
    """The request's Constraint, or None. Raises BadRequestError (naming the field) for a malformed one."""
    names = given(req)
    if not names:
        _check_response_format(getattr(req, "response_format", None))
        return None
    if len(names) > 1:
        raise BadRequestError(
            f"{names[0]} and {names[1]} both constrain the answer; give at most one structured output field.",
            param=names[1],
        )
    name = names[0]
    value = getattr(req, name)
    if name == "response_format":
        return _response_format(value)
    if name == "structured_outputs":
        return _structured_outputs(value)
    if name in ("guided_json", "json_schema"):
        return schema_constraint(value, name)
    if name == "guided_regex":
        return Constraint("regex", _string(value, name))
    if name == "guided_choice":
        return Constraint("choice", _choices(value, name))
    return grammar_constraint(value, name)  # guided_grammar, grammar


def _check_response_format(value: Any) -> None:
    if value is not None and (not isinstance(value, dict) or value.get("type") != "text"):
        _response_format(value)


def _response_format(value: Any) -> Constraint | None:
    if not isinstance(value, dict):
        raise BadRequestError("response_format must be an object with a `type`.", param="response_format")
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        schema = value.get("schema")  # llama.cpp's server takes a schema here too
        if schema is not None:
            return schema_constraint(schema, "response_format.schema")
        return Constraint("json_object", "")
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict):
            raise BadRequestError("response_format.json_schema must be an object with `name` and `schema`.",
                                  param="response_format.json_schema")
        schema = spec.get("schema", spec.get("schema_"))
        if schema is None:  # OpenAI makes `schema` optional: then any JSON object
            return Constraint("json_object", "")
        return schema_constraint(schema, "response_format.json_schema.schema")
    raise BadRequestError(
        f"response_format.type {kind!r} is not supported; use 'text', 'json_object' or 'json_schema'.",
        param="response_format.type",
    )


def _structured_outputs(value: Any) -> Constraint | None:
    if not isinstance(value, dict):
        raise BadRequestError("structured_outputs must be an object.", param="structured_outputs")
    unknown = [k for k in value if k not in STRUCTURED_OUTPUT_KEYS + STRUCTURED_OUTPUT_OPTIONS]
    if unknown:
        raise BadRequestError(
            f"structured_outputs.{unknown[0]} is not supported; use one of {', '.join(STRUCTURED_OUTPUT_KEYS)}.",
            param=f"structured_outputs.{unknown[0]}",
        )
    keys = [k for k in STRUCTURED_OUTPUT_KEYS if value.get(k) not in (None, False)]
    if len(keys) != 1:
        raise BadRequestError(
            f"structured_outputs must set exactly one of {', '.join(STRUCTURED_OUTPUT_KEYS)}"
            + (f", got {', '.join(keys)}." if keys else "."),
            param="structured_outputs",
        )
    key = keys[0]
    param = f"structured_outputs.{key}"
    inner = value[key]
    if key == "json":
        return schema_constraint(inner, param)
    if key == "json_object":
        return Constraint("json_object", "")
    if key == "regex":
        return Constraint("regex", _string(inner, param))
    if key == "choice":
        return Constraint("choice", _choices(inner, param))
    return grammar_constraint(inner, param)


def schema_constraint(schema: Any, param: str) -> Constraint:
    """A JSON Schema (an object, a boolean, or JSON text) as a constraint; 400 naming `param` if it is none.
    Every family's schema field comes through here (OpenAI's, vLLM's, llama.cpp's, Llama Stack's)."""
    return Constraint("json_schema", _schema_text(schema, param))


def grammar_constraint(grammar_text: Any, param: str) -> Constraint:
    """A grammar (GBNF, or Lark: the grammar library tells them apart) as a constraint; 400 if not text."""
    return Constraint("gbnf", _string(grammar_text, param))


def _schema_text(schema: Any, param: str) -> str:
    """A schema given as an object, a boolean, or JSON text -> canonical JSON text (the cache key)."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError:
            raise BadRequestError(f"{param} is not valid JSON.", param=param) from None
    if not isinstance(schema, dict | bool):
        raise BadRequestError(f"{param} must be a JSON Schema object.", param=param)
    try:
        return json.dumps(schema, separators=(",", ":"))  # key order kept: properties come out in it
    except (ValueError, RecursionError):
        raise BadRequestError(f"{param} is nested too deeply.", param=param) from None


def _string(value: Any, param: str) -> str:
    if not isinstance(value, str) or not value:
        raise BadRequestError(f"{param} must be a non-empty string.", param=param)
    return value


def _choices(value: Any, param: str) -> str:
    if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
        raise BadRequestError(f"{param} must be a non-empty list of non-empty strings.", param=param)
    return json.dumps(value)


async def check(constraint: Constraint | None, tokenizer: Any, param: str | None) -> None:
    """Compile `constraint` off the event loop (cached for the engine); a grammar error is a 400 naming `param`."""
    if constraint is None:
        return
    try:
        await asyncio.to_thread(grammar.validate, constraint, tokenizer)
    except grammar.GrammarError as exc:
        raise BadRequestError(f"{param or 'response_format'}: {exc.message}", param=param) from None
