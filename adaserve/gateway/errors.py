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
from starlette.exceptions import HTTPException as StarletteHTTPException

from adaserve.body_limit import BodyTooLarge
from adaserve.contract.openai import ErrorResponse
from adaserve.contract.openai_format import ERROR_TYPES, error_body
from adaserve.error_fields import validation_message

log = logging.getLogger("adaserve.gateway")

TYPES = ERROR_TYPES  # the shape is the contract's: a worker's own OpenAI routes answer in it too


class ApiError(Exception):
    def __init__(self, status: int, message: str, *, code: str | None = None, param: str | None = None,
                 retry_after: int | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.param, self.retry_after = status, message, code, param, retry_after

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, code=self.code, param=self.param)


async def api_error(_request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, ApiError)
    headers = {"Retry-After": str(exc.retry_after)} if exc.retry_after is not None else None
    return JSONResponse(exc.body(), status_code=exc.status, headers=headers)


async def invalid_request(_request: Request, exc: Exception) -> JSONResponse:
    """Validation errors as 400 (OpenAI answers 400 for a malformed body, not 422) naming every field."""
    assert isinstance(exc, RequestValidationError)
    message, param = validation_message(exc.errors())
    return JSONResponse(error_body(400, message, param=param, code="invalid_request"), status_code=400)


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
