"""The OpenAPI document users read at /docs, made true to what the server answers.

FastAPI documents a 422 `HTTPValidationError` on every route with a body; Peregrine never sends one (a body
that does not validate is a 400 in the OpenAI error envelope, see app/errors.py). This swaps that entry for
the 400 envelope.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

ERROR_ENVELOPE_SCHEMA: dict[str, Any] = {
    "title": "ErrorResponse",
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "integer", "null"]},
            },
        }
    },
}
OLLAMA_ERROR_SCHEMA: dict[str, Any] = {  # Ollama's routes (/api/*, app/ollama/) answer in Ollama's envelope
    "title": "OllamaErrorResponse",
    "type": "object",
    "required": ["error"],
    "properties": {"error": {"type": "string"}},
}
_OLLAMA_BAD_REQUEST = {
    "description": "Invalid request: Ollama's error envelope",
    "content": {"application/json": {"schema": {"$ref": "#/components/schemas/OllamaErrorResponse"}}},
}
_BAD_REQUEST = {
    "description": "Invalid request: the OpenAI error envelope, `param` names the field at fault",
    "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}},
}


def install_openapi(app: FastAPI) -> None:
    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = build(app)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def build(app: FastAPI) -> dict[str, Any]:
    spec = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
    for path, path_item in spec.get("paths", {}).items():
        bad_request = _OLLAMA_BAD_REQUEST if path.startswith("/api/") else _BAD_REQUEST
        for operation in path_item.values():
            responses = operation.get("responses", {})
            if responses.pop("422", None) is not None:
                responses.setdefault("400", bad_request)
            if path == "/" and "content" in responses.get("200", {}):
                # the chat page to browsers, Ollama's plain-text liveness answer to other clients (app/ollama)
                responses["200"]["content"].setdefault("text/plain", {"schema": {"type": "string"}})
            if path.startswith("/api/") and "content" in responses.get("200", {}):
                # Ollama's generating routes and /api/pull stream one JSON object a line unless "stream": false
                responses["200"]["content"].setdefault("application/x-ndjson", {"schema": {}})
    schemas = spec.setdefault("components", {}).setdefault("schemas", {})
    schemas.pop("HTTPValidationError", None)
    schemas.pop("ValidationError", None)
    schemas["ErrorResponse"] = ERROR_ENVELOPE_SCHEMA
    schemas["OllamaErrorResponse"] = OLLAMA_ERROR_SCHEMA
    return spec
