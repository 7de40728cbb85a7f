"""The gateway's FastAPI app, around a Gateway the caller built (so bad settings fail before serving)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from redis.exceptions import RedisError
from starlette.exceptions import HTTPException as StarletteHTTPException

from adaserve import __version__
from adaserve.body_limit import BodyLimit
from adaserve.gateway import errors
from adaserve.gateway.routes import health, metrics, models, openai
from adaserve.gateway.service import Gateway


def create_app(gateway: Gateway) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await gateway.start()
        try:
            yield
        finally:
            await gateway.stop()

    app = FastAPI(title="adaserve gateway", version=__version__, lifespan=lifespan)
    app.state.gateway = gateway
    for module in (openai, models, health, metrics):
        app.include_router(module.router)
    app.add_exception_handler(errors.ApiError, errors.api_error)
    app.add_exception_handler(RequestValidationError, errors.invalid_request)
    app.add_exception_handler(StarletteHTTPException, errors.http_error)
    app.add_exception_handler(RedisError, errors.store_unavailable)
    app.add_exception_handler(Exception, errors.unexpected)
    # outermost: an oversize body is refused before any part of the app buffers it
    app.add_middleware(BodyLimit, max_bytes=gateway.settings.max_body_bytes, render=errors.too_large)
    app.openapi = lambda: _openapi(app)  # type: ignore[method-assign]
    return app


def _openapi(app: FastAPI) -> dict[str, Any]:
    """FastAPI's document as this gateway answers: no 422 (a bad request is 400, declared per route), and the SLO
    class, in the body or the ``X-SLO-Class`` header, one of this gateway's classes (any other is 400)."""
    if app.openapi_schema is None:
        doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
        names = list(app.state.gateway.catalog.classes)
        one_of_ours = {"anyOf": [{"enum": names}, {"type": "null"}]}
        for path in doc.get("paths", {}).values():
            for op in path.values():
                op.get("responses", {}).pop("422", None)
                for param in op.get("parameters", []):
                    if param.get("name") == "X-SLO-Class":  # a header is text or absent, never null
                        param["schema"] = {"type": "string", "enum": names}
        schemas = doc.get("components", {}).get("schemas", {})
        for name in ("HTTPValidationError", "ValidationError"):
            schemas.pop(name, None)
        for name in ("CompletionRequest", "ChatRequest"):
            if "slo_class" in schemas.get(name, {}).get("properties", {}):
                schemas[name]["properties"]["slo_class"] = one_of_ours
        # unknown fields: accepted and ignored (the schemas say additionalProperties: true), or refused
        strict = app.state.gateway.settings.strict_openai_fields
        for schema in schemas.values():
            if schema.get("additionalProperties") is True:
                schema["additionalProperties"] = not strict
        app.openapi_schema = doc
    return app.openapi_schema
