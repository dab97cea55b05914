"""The OpenAI error envelope and every exception handler, in one place.

Every error a client sees has the shape the OpenAI SDKs unwrap:

    {"error": {"message": "...", "type": "invalid_request_error", "param": "max_tokens", "code": ...}}

Routes and converters raise typed errors (`APIError` subclasses, or the engine's `EngineError`s); this
module maps each to a status code once. FastAPI's own 422 (a body that does not validate) becomes a 400
naming the offending field in `param`. Anything unexpected is a 500, logged with the request id, and the
client is told only that id. Errors that happen after a stream has started go out as one event with the
same body (see `error_body`, used by `app/streaming.py`).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine.types import EngineDeadError, EngineError, InvalidRequestError, PromptTooLongError

log = logging.getLogger("peregrine.app")


class APIError(Exception):
    """An error meant for the client. Subclasses fix the status and the envelope's `type`."""

    status_code: int = 400
    error_type: str = "invalid_request_error"

    def __init__(self, message: str, *, param: str | None = None, code: str | int | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


class BadRequestError(APIError):
    status_code = 400


class AuthenticationError(APIError):
    status_code = 401
    error_type = "authentication_error"


class PermissionDeniedError(APIError):
    status_code = 403
    error_type = "permission_error"


class NotFoundError(APIError):
    status_code = 404
    error_type = "not_found_error"


class RateLimitError(APIError):
    status_code = 429
    error_type = "rate_limit_error"


class ServiceUnavailableError(APIError):
    status_code = 503
    error_type = "service_unavailable"


class EngineFailureError(APIError):
    """The engine failed while serving this request (not the client's fault)."""

    status_code = 500
    error_type = "internal_server_error"


def model_not_found(name: str, served: Sequence[str]) -> NotFoundError:
    return NotFoundError(
        f"The model '{name}' does not exist. This server serves: {', '.join(served)}.",
        param="model",
        code="model_not_found",
    )


def error_body(
    message: str, error_type: str, param: str | None = None, code: str | int | None = None
) -> dict:
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def classify(exc: BaseException, request_id: str | None = None) -> tuple[int, dict[str, Any]]:
    """Map any exception to (status, envelope). The single table of error -> status."""
    if isinstance(exc, APIError):
        return exc.status_code, error_body(exc.message, exc.error_type, exc.param, exc.code)
    if isinstance(exc, PromptTooLongError):
        return 400, error_body(str(exc), "invalid_request_error", exc.param, "context_length_exceeded")
    if isinstance(exc, InvalidRequestError):
        return 400, error_body(str(exc), "invalid_request_error", exc.param, None)
    if isinstance(exc, EngineDeadError):
        return 503, error_body(
            f"The engine is not running: {exc}", "service_unavailable", None, "engine_dead"
        )
    if isinstance(exc, EngineError):
        return 500, error_body(f"Engine error: {exc}", "internal_server_error", None, "engine_error")
    log.error("unhandled error (request id %s)", request_id, exc_info=exc)
    message = f"Internal server error (request id {request_id}). The server log has the details."
    return 500, error_body(message, "internal_server_error", None, "internal_error")


def _request_id(request: Request) -> str | None:
    return getattr(request.state, "request_id", None)


def _validation_message(errors: Sequence[dict[str, Any]]) -> tuple[str, str | None]:
    """A readable sentence for pydantic's error list, and the first offending field as `param`."""
    parts: list[str] = []
    param: str | None = None
    for err in errors:
        loc = [str(p) for p in err.get("loc", ()) if p != "body"]
        if err.get("type") == "json_invalid":
            parts.append(
                f"The request body is not valid JSON: {err.get('ctx', {}).get('error', err.get('msg'))}"
            )
            continue
        if not loc:  # the body as a whole: absent, not JSON, or not an object
            hint = " with Content-Type: application/json" if isinstance(err.get("input"), bytes) else ""
            parts.append(f"The request body must be a JSON object{hint}.")
            continue
        field = ".".join(loc)
        param = param or (loc[0] if loc else None)
        shown = "input" in err and err.get("type") != "missing"
        got = f" (got {json.dumps(err['input'], default=str)[:100]})" if shown else ""
        parts.append(f"{field or 'body'}: {err.get('msg', 'invalid value')}{got}")
    return "; ".join(parts) or "Invalid request.", param


async def _api_error(request: Request, exc: Exception) -> JSONResponse:
    status, body = classify(exc, _request_id(request))
    retry_after = getattr(exc, "retry_after", None)  # e.g. a model still loading (serving/registry.py)
    headers = {"Retry-After": str(retry_after)} if retry_after is not None else None
    return JSONResponse(body, status_code=status, headers=headers)


async def _validation_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)  # registered for this class only
    message, param = _validation_message(exc.errors())
    return JSONResponse(error_body(message, "invalid_request_error", param, 400), status_code=400)


async def _http_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)  # registered for this class only
    if exc.status_code == 404:
        message = f"Not found: {request.method} {request.url.path}"
        error_type = "not_found_error"
    elif exc.status_code == 405:
        message = f"Method {request.method} is not allowed on {request.url.path}"
        error_type = "invalid_request_error"
    else:
        message, error_type = str(exc.detail), "invalid_request_error"
    body = error_body(message, error_type, None, exc.status_code)
    return JSONResponse(body, status_code=exc.status_code, headers=getattr(exc, "headers", None))


def install_error_handlers(app: FastAPI) -> None:
    """Typed errors and framework errors. Unhandled exceptions become the 500 envelope in
    `app.server.RequestIdMiddleware`, which knows the request id and can still set the header."""
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(EngineError, _api_error)
