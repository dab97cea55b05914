"""/openapi.json (and so /docs) documents the 400 error envelope Peregrine sends, not FastAPI's 422."""

from __future__ import annotations

import jsonschema
from fastapi.testclient import TestClient

from app.openapi import ERROR_ENVELOPE_SCHEMA
from app.server import create_app


def test_no_route_documents_a_422_and_body_routes_document_the_400_envelope() -> None:
    spec = create_app(None, None).openapi()
    operations = [(path, op) for path, item in spec["paths"].items() for op in item.values()]
    assert not [path for path, op in operations if "422" in op["responses"]]
    with_body = [(path, op) for path, op in operations if "requestBody" in op]
    assert with_body, "expected POST routes with a JSON body"
    for path, op in with_body:
        ref = op["responses"]["400"]["content"]["application/json"]["schema"]["$ref"]
        envelope = ("AnthropicErrorResponse" if path.startswith("/v1/messages")  # each family's own
                    else "OllamaErrorResponse" if path.startswith("/api/") else "ErrorResponse")
        assert ref == f"#/components/schemas/{envelope}", path
    assert "HTTPValidationError" not in spec["components"]["schemas"]


def test_a_real_validation_error_matches_the_documented_envelope() -> None:
    client = TestClient(create_app(None, None))
    response = client.post("/v1/chat/completions", json={"model": "m", "messages": "not a list"})
    assert response.status_code == 400
    jsonschema.validate(response.json(), ERROR_ENVELOPE_SCHEMA)


async def test_the_schema_is_built_when_the_server_starts_not_on_the_first_request() -> None:
    app = create_app(None, None)
    assert app.openapi_schema is None
    async with app.router.lifespan_context(app):
        assert app.openapi_schema is not None and "/v1/chat/completions" in app.openapi_schema["paths"]
