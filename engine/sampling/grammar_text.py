"""A `Constraint` as llguidance grammar text: JSON schemas, regexes (with ASCII `\\d` / `\\w`), choices, Lark
and GBNF, bounded in size and nesting. `engine/sampling/grammar.py` compiles and caches what this returns."""

from __future__ import annotations

import json
from typing import Any

import llguidance

from engine.types import Constraint

MAX_GRAMMAR_CHARS = 64 * 1024  # a schema / regex / grammar source longer than this is refused
MAX_SCHEMA_DEPTH = 32  # JSON nesting of a schema's text

# JSON output: compact but readable separators and no free whitespace, so a small model cannot loop on spaces
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GrammarError(ValueError):
    """The constraint cannot be compiled (invalid, unsupported, too large or too slow); the app answers 400."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


def grammar_text(constraint: Constraint) -> str:
    """The llguidance grammar (its JSON form) for a constraint; GrammarError for bad input."""
    kind, value = constraint.kind, constraint.value
    if len(value) > MAX_GRAMMAR_CHARS:
        raise GrammarError(f"the {kind} is {len(value)} characters long; the limit is {MAX_GRAMMAR_CHARS}")
    try:
        if kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema('{"type": "object"}', overrides=JSON_OPTIONS)
        if kind == "json_schema":
            schema = _load_json(value, "JSON schema")
            if not isinstance(schema, dict | bool):
                raise GrammarError("a JSON schema must be an object (or a boolean)")
            return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=JSON_OPTIONS)
        if kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(ascii_classes(value))
        if kind == "choice":
            choices = _load_json(value, "choice list")
            if not isinstance(choices, list) or not choices or not all(isinstance(c, str) for c in choices):
                raise GrammarError("a choice must be a non-empty list of strings")
            lark = "start: " + " | ".join(json.dumps(c) for c in choices)
            return llguidance.LLMatcher.grammar_from_lark(lark)
        if kind == "lark":
            return llguidance.LLMatcher.grammar_from_lark(value)
        if kind == "gbnf":
            from llguidance.gbnf_to_lark import any_to_lark

            return llguidance.LLMatcher.grammar_from_lark(any_to_lark(value))
    except GrammarError:
        raise
    except RecursionError as exc:
        raise GrammarError(f"the {kind} is nested too deeply") from exc
    except Exception as exc:  # ValueError from llguidance, GbnfToLarkError, ...
        raise GrammarError(f"invalid {kind}: {exc}") from exc
    raise GrammarError(f"unknown constraint kind {kind!r}")


_OUTSIDE = {"d": "[0-9]", "w": "[0-9A-Za-z_]", "D": "[^0-9]", "W": "[^0-9A-Za-z_]"}
_INSIDE = {"d": "0-9", "w": "0-9A-Za-z_"}


def ascii_classes(regex: str) -> str:
    """`\\d` and `\\w` as ASCII classes, as in JSON Schema patterns, Outlines and xgrammar (llguidance's regex
    syntax, Rust's, makes them Unicode: `\\d` would match Arabic-Indic digits)."""
    out, i, depth = [], 0, 0  # depth: inside a [...] class
    while i < len(regex):
        c = regex[i]
        if c == "\\" and i + 1 < len(regex):
            nxt = regex[i + 1]
            table = _INSIDE if depth else _OUTSIDE
            out.append(table.get(nxt, c + nxt))
            i += 2
            continue
        if c == "[":
            depth += 1
            if regex.startswith("[^]", i) or regex.startswith("[]", i):  # a leading ] is a literal
                skip = 3 if regex[i + 1] == "^" else 2
                out.append(regex[i:i + skip])
                i += skip
                continue
        elif c == "]" and depth:
            depth -= 1
        out.append(c)
        i += 1
    return "".join(out)


def _load_json(text: str, what: str) -> Any:
    try:
        value = json.loads(text)
    except RecursionError as exc:
        raise GrammarError(f"the {what} is nested too deeply") from exc
    except ValueError as exc:
        raise GrammarError(f"the {what} is not valid JSON: {exc}") from exc
    if _depth(value) > MAX_SCHEMA_DEPTH:
        raise GrammarError(f"the {what} is nested more than {MAX_SCHEMA_DEPTH} levels deep")
    return value


def _depth(value: Any) -> int:
    """Nesting depth of a JSON value, without recursion."""
    best, stack = 0, [(value, 1)]
    while stack:
        item, d = stack.pop()
        if isinstance(item, dict | list):
            best = max(best, d)
            if d > MAX_SCHEMA_DEPTH:
                return d
            stack.extend((v, d + 1) for v in (item.values() if isinstance(item, dict) else item))
    return best


