"""The gateway's FastAPI app, around a Gateway the caller built (so bad settings fail before serving)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from adaserve import __version__
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
    app.add_exception_handler(Exception, errors.unexpected)
    return app
