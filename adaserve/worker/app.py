"""The worker's FastAPI app, built around a runtime that the caller owns.

The lifespan starts the runtime in the background (models, profile, warm-up) so ``/healthz`` answers
while a large model loads; ``/readyz`` turns 200 once the engine is warm.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.exception_handlers import http_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from adaserve import __version__
from adaserve.body_limit import BodyLimit, BodyTooLarge
from adaserve.contract.openai import ErrorResponse
from adaserve.contract.openai_format import error_body
from adaserve.error_fields import field_path, validation_message
from adaserve.worker.routes import generate, health, metrics, openai, profile, requests
from adaserve.worker.routes.deps import require_token
from adaserve.worker.routes.openai import OPENAI_PATHS
from adaserve.worker.runtime import RequestRefused, Runtime


def create_app(runtime: Runtime) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        starting = asyncio.create_task(runtime.startup(), name="adaserve-startup")
        try:
            yield
        finally:
            if not starting.done():
                starting.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await starting
            await runtime.shutdown()

    app = FastAPI(title="adaserve worker", version=__version__, lifespan=lifespan)
    app.state.runtime = runtime
    # every route but the probes' and the scraper's needs the token, when the worker has one (routes/deps.py)
    for module in (generate, openai, requests, profile):
        app.include_router(module.router, dependencies=[Depends(require_token)])
    for module in (health, metrics):
        app.include_router(module.router)
    app.add_exception_handler(RequestRefused, _refused)
    app.add_exception_handler(RequestValidationError, _invalid)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    # outermost: an oversize body is refused before FastAPI reads it into memory
    app.add_middleware(BodyLimit, max_bytes=runtime.settings.max_body_bytes, render=_too_large)
    app.openapi = lambda: _openapi(app)  # type: ignore[method-assign]
    return app


class Problem(BaseModel):
    """Every error this worker answers: ``detail`` names the field; validation errors (422) list them all."""

    detail: str
    errors: list[dict[str, str]] | None = None


# what POST /v1/generate answers besides 200 (docs/worker.md "Errors")
GENERATE_ERRORS = {"400": "the engine can never serve it (context, vocabulary, KV)", "409": "request_id in flight",
                   "413": "body over ADASERVE_MAX_BODY_BYTES", "422": "malformed body or field",
                   "503": "loading, draining or overloaded; Retry-After"}


# what POST /v1/completions and /v1/chat/completions answer besides 200, in OpenAI's shape
OPENAI_ERRORS = {"400": "a malformed body or field (named), an unknown slo_class, a prompt the engine can never "
                        "serve", "404": "model is not the one this worker serves",
                 "409": "request id in flight", "413": "body over ADASERVE_MAX_BODY_BYTES",
                 "500": "the engine ended the request with an error",
                 "503": "loading, draining or overloaded; Retry-After"}


def _openapi(app: FastAPI) -> dict[str, Any]:
    """FastAPI's document with this worker's error shape (``Problem``, not FastAPI's list of errors) and the
    statuses ``/v1/generate`` answers; ``/metrics`` as text."""
    if app.openapi_schema is None:
        doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
        problem = {"$ref": "#/components/schemas/Problem"}
        openai_error = {"$ref": "#/components/schemas/ErrorResponse"}
        schemas = doc.setdefault("components", {}).setdefault("schemas", {})
        schemas["Problem"] = Problem.model_json_schema()
        schemas.update(ErrorResponse.model_json_schema(ref_template="#/components/schemas/{model}").pop("$defs"))
        schemas["ErrorResponse"] = ErrorResponse.model_json_schema(ref_template="#/components/schemas/{model}")
        for name in ("HTTPValidationError", "ValidationError"):
            schemas.pop(name, None)
        for path, ops in doc.get("paths", {}).items():
            for method, op in ops.items():
                responses = op.setdefault("responses", {})
                if path == "/v1/generate" and method == "post":
                    for status, why in GENERATE_ERRORS.items():
                        responses[status] = {"description": why}
                    # one JSON body, or server-sent events; before OpenAPI 3.2 the schema is each event's
                    responses["200"].setdefault("content", {})["text/event-stream"] = {"schema": {
                        "type": "object", "properties": {"data": {"type": "string"}}, "required": ["data"]}}
                if path in OPENAI_PATHS and method == "post":
                    for status, why in OPENAI_ERRORS.items():
                        responses[status] = {"description": why}
                    responses.pop("422", None)
                    responses["200"].setdefault("content", {})["text/event-stream"] = {"schema": {
                        "type": "object", "properties": {"data": {"type": "string"}}, "required": ["data"]}}
                if method == "delete":
                    responses["404"] = {"description": "no such request in flight"}
                for status, answer in responses.items():
                    if status.startswith(("4", "5")):
                        shape = openai_error if path in OPENAI_PATHS else problem
                        answer["content"] = {"application/json": {"schema": shape}}
        if "/metrics" in doc.get("paths", {}):
            doc["paths"]["/metrics"]["get"]["responses"]["200"]["content"] = {"text/plain": {}}
        # this worker's own limits, which the contract's schema cannot know
        settings = app.state.runtime.settings
        body = schemas.get("GenerateRequest", {}).get("properties", {})
        if "max_tokens" in body:
            body["max_tokens"] = {"anyOf": [{"type": "integer", "minimum": 1, "maximum": settings.max_tokens_limit},
                                            {"type": "null"}]}
        if body:  # the rules between fields (GenerateRequest._one_prompt) as JSON Schema
            fields = ("prompt", "prompt_token_ids", "messages")
            given = {"not": {"type": "null"}}
            one_prompt = [{"required": [f], "properties": {g: given if g == f else {"type": "null"} for g in fields}}
                          for f in fields]  # exactly one of the three, the others absent or null
            resume = [{"properties": {"resume_text": {"type": "null"}}},  # resume_text needs resume_token_ids
                      {"required": ["resume_token_ids"], "properties": {"resume_token_ids": given}}]
            schemas["GenerateRequest"]["allOf"] = [{"anyOf": one_prompt}, {"anyOf": resume}]
        if settings.slo_classes and "slo_class" in body:
            body["slo_class"] = {"anyOf": [{"enum": sorted({*settings.slo_classes, settings.default_slo_class})},
                                           {"type": "null"}]}
        app.openapi_schema = doc
    return app.openapi_schema


def _too_large(exc: BodyTooLarge) -> dict[str, Any]:
    """Answered before the route is known: both shapes, ``detail`` and OpenAI's ``error``."""
    return {"detail": str(exc.detail), **error_body(413, str(exc.detail), code="body_too_large")}


def _openai(request: Request) -> bool:
    """The OpenAI routes answer errors in OpenAI's shape, and a malformed body with 400, as the gateway does."""
    return request.url.path in OPENAI_PATHS


async def _refused(request: Request, exc: Exception) -> JSONResponse:
    if not isinstance(exc, RequestRefused):
        raise exc
    headers = {"Retry-After": str(exc.retry_after)} if exc.retry_after is not None else None
    if _openai(request):
        status = 400 if exc.status == 422 else exc.status
        return JSONResponse(error_body(status, exc.message, code=exc.code, param=exc.param), status_code=status,
                            headers=headers)
    return JSONResponse({"detail": exc.message}, status_code=exc.status, headers=headers)


async def _http_error(request: Request, exc: Exception) -> Any:
    if not isinstance(exc, StarletteHTTPException):
        raise exc
    if _openai(request):
        code = "body_too_large" if isinstance(exc, BodyTooLarge) else None
        return JSONResponse(error_body(exc.status_code, str(exc.detail), code=code), status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))
    return await http_exception_handler(request, exc)


async def _invalid(request: Request, exc: Exception) -> JSONResponse:
    if not isinstance(exc, RequestValidationError):
        raise exc
    if _openai(request):
        message, param = validation_message(exc.errors())
        return JSONResponse(error_body(400, message, param=param, code="invalid_request"), status_code=400)
    errors = [{"field": field_path(tuple(e.get("loc", ()))) or "body",
               "message": str(e.get("msg", "")).removeprefix("Value error, "), "type": e.get("type", "")}
              for e in exc.errors()]
    # a rule over the whole body ("body") names its fields itself
    detail = "; ".join(f"{e['field']}: {e['message']}" if e["field"] != "body" else e["message"]
                       for e in errors) or "invalid request"
    return JSONResponse({"detail": detail, "errors": errors}, status_code=422)
