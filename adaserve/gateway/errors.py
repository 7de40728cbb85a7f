"""Errors as OpenAI's API shapes them: ``{"error": {"message", "type", "param", "code"}}``.

The official client turns these into typed exceptions (BadRequestError, AuthenticationError,
RateLimitError, ...), so callers handle them as they would OpenAI's own.
"""

from __future__ import annotations

from typing import Any

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from adaserve.error_fields import field_path

TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
         409: "invalid_request_error", 422: "invalid_request_error", 429: "rate_limit_error",
         503: "service_unavailable", 502: "server_error", 504: "server_error"}


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
        parts.append(f"{where}: {msg}" if where else msg)
    param = field_path(tuple(errors[0].get("loc", ()))) if errors else None
    return JSONResponse(error_body(400, "; ".join(parts) or "invalid request", param=param or None,
                                   code="invalid_request"), status_code=400)


async def http_error(_request: Request, exc: Exception) -> JSONResponse:
    """Starlette's own errors (404 for an unknown path, 405) in the same shape."""
    assert isinstance(exc, StarletteHTTPException)
    return JSONResponse(error_body(exc.status_code, str(exc.detail)), status_code=exc.status_code,
                        headers=getattr(exc, "headers", None))


async def unexpected(_request: Request, exc: Exception) -> JSONResponse:
    """A bug must still answer in the API's shape; the traceback goes to the log, not the client."""
    import logging

    logging.getLogger("adaserve.gateway").exception("unhandled error", exc_info=exc)
    return JSONResponse(error_body(500, f"internal error ({type(exc).__name__}); see the gateway log"),
                        status_code=500)
