"""Dependencies the routers share, as named Annotated types, and the token check of the protected routes."""

from __future__ import annotations

import hmac
from typing import Annotated

from fastapi import Depends, Request

from adaserve.worker.runtime import RequestRefused, Runtime


def get_runtime(request: Request) -> Runtime:
    return request.app.state.runtime


RuntimeDep = Annotated[Runtime, Depends(get_runtime)]


def require_token(request: Request) -> None:
    """With ``ADASERVE_AUTH_TOKEN`` set, 401 unless the request carries ``Authorization: Bearer <token>`` (the
    gateway's ``ADASERVE_GATEWAY_WORKER_TOKEN``; an OpenAI client's api_key sends it the same way)."""
    token = get_runtime(request).settings.auth_token
    if token is None:
        return
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), token.get_secret_value().encode()):
        raise RequestRefused(401, "this worker requires its token: Authorization: Bearer <ADASERVE_AUTH_TOKEN>",
                             code="invalid_api_key")
