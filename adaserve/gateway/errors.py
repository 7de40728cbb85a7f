"""Errors as OpenAI's API shapes them: ``{"error": {"message", "type", "param", "code"}}``.

The official client turns these into typed exceptions (BadRequestError, AuthenticationError,
RateLimitError, ...), so callers handle them as they would OpenAI's own.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from adaserve.body_limit import BodyTooLarge
from adaserve.error_fields import field_path

log = logging.getLogger("adaserve.gateway")

TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
         405: "invalid_request_error", 409: "invalid_request_error", 413: "invalid_request_error",
         422: "invalid_request_error", 429: "rate_limit_error", 503: "service_unavailable", 502: "server_error",
         504: "server_error"}


class ApiError(Exception):
    def __init__(self, status: int, message: str, *, code: str | None = None, param: str | None = None,
                 retry_after: int | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.param, self.retry_after = status, message, code, param, retry_after

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, code=self.code, param=self.param)


def error_body(status: int, message: str, *, code: str | None = None, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": TYPES.get(status, "server_error"), "param": param, "code": code}}


async def api_error(_request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, ApiError)
    headers = {"Retry-After": str(exc.retry_after)} if exc.retry_after is not None else None
    return JSONResponse(exc.body(), status_code=exc.status, headers=headers)


async def invalid_request(_request: Request, exc: Exception) -> JSONResponse:
    """Validation errors as 400 (OpenAI answers 400 for a malformed body, not 422) naming every field."""
    assert isinstance(exc, RequestValidationError)
    errors = exc.errors()
    parts = []
    for e in errors:
        where = field_path(tuple(e.get("loc", ())))
        msg = str(e.get("msg", "")).removeprefix("Value error, ")
        # a rule over the whole body names its fields itself
        parts.append(f"{where}: {msg}" if where and where != "body" else msg)
    param = field_path(tuple(errors[0].get("loc", ()))) if errors else None
    param = None if param == "body" else param
    return JSONResponse(error_body(400, "; ".join(parts) or "invalid request", param=param or None,
                                   code="invalid_request"), status_code=400)


async def http_error(_request: Request, exc: Exception) -> JSONResponse:
    """Starlette's own errors (404 for an unknown path, 405) and an oversize body (413) in the same shape."""
    assert isinstance(exc, StarletteHTTPException)
    code = "body_too_large" if isinstance(exc, BodyTooLarge) else None
    return JSONResponse(error_body(exc.status_code, str(exc.detail), code=code), status_code=exc.status_code,
                        headers=getattr(exc, "headers", None))


def too_large(exc: BodyTooLarge) -> dict[str, Any]:
    """The 413 that BodyLimit answers itself (a declared Content-Length over the limit)."""
    return error_body(413, str(exc.detail), code="body_too_large")


async def store_unavailable(request: Request, exc: Exception) -> JSONResponse:
    """Redis unreachable where an answer needs it (a request's record): 503 and when to retry, not a 500."""
    log.warning("state store unreachable: %s: %s", type(exc).__name__, exc)
    retry_after = request.app.state.gateway.settings.retry_after_s
    return JSONResponse(error_body(503, f"the state store (Redis) is unreachable ({type(exc).__name__}); retry later",
                                   code="state_store_unavailable"), status_code=503,
                        headers={"Retry-After": str(retry_after)})


async def unexpected(_request: Request, exc: Exception) -> JSONResponse:
    """A bug must still answer in the API's shape; the traceback goes to the log, not the client."""
    log.exception("unhandled error", exc_info=exc)
    return JSONResponse(error_body(500, f"internal error ({type(exc).__name__}); see the gateway log"),
                        status_code=500)


# ---- what the OpenAPI document declares (app.py removes FastAPI's 422, which this API never answers) ----------


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    error: ErrorDetail


WHEN = {
    400: "a malformed body or a bad field (named), an unknown SLO class, a prompt the model cannot serve",
    401: "API keys are on and the key is missing, malformed or unknown",
    404: "unknown model, or no such record (for this API key)",
    413: "the request body is over the gateway's limit (max_body_bytes)",
    429: "the API key's rate limit; Retry-After says when to retry",
    502: "the worker failed after the answer began (a non-streamed request); code worker_failed",
    503: "shed, overloaded, no_workers, queue_full, slo_infeasible, workers_failed, or the state store "
         "unreachable; Retry-After says when to retry",
}


def declared(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """``responses=`` of a route: these error statuses, in the error shape."""
    return {s: {"model": ErrorResponse, "description": WHEN[s]} for s in statuses}
