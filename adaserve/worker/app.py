"""The worker's FastAPI app, built around a runtime that the caller owns.

The lifespan starts the runtime in the background (models, profile, warm-up) so ``/healthz`` answers
while a large model loads; ``/readyz`` turns 200 once the engine is warm.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from adaserve import __version__
from adaserve.error_fields import field_path
from adaserve.worker.routes import generate, health, metrics, profile, requests
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
    for module in (generate, requests, health, profile, metrics):
        app.include_router(module.router)
    app.add_exception_handler(RequestRefused, _refused)
    app.add_exception_handler(RequestValidationError, _invalid)
    return app


async def _refused(_request: Request, exc: Exception) -> JSONResponse:
    if not isinstance(exc, RequestRefused):
        raise exc
    headers = {"Retry-After": str(exc.retry_after)} if exc.retry_after is not None else None
    return JSONResponse({"detail": exc.message}, status_code=exc.status, headers=headers)


async def _invalid(_request: Request, exc: Exception) -> JSONResponse:
    if not isinstance(exc, RequestValidationError):
        raise exc
    errors = [{"field": field_path(tuple(e.get("loc", ()))) or "body", "message": e.get("msg", ""),
               "type": e.get("type", "")} for e in exc.errors()]
    detail = "; ".join(f"{e['field']}: {e['message']}" for e in errors) or "invalid request"
    return JSONResponse({"detail": detail, "errors": errors}, status_code=422)
