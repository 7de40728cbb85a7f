"""``GET /v1/models``, ``GET /v1/slo-classes`` and ``GET /v1/requests/{id}`` (a request's record)."""

from __future__ import annotations

import time
from typing import Annotated, Any

from fastapi import APIRouter, Path

from adaserve.contract.generate import REQUEST_ID_PATTERN  # one id syntax: the gateway's ids reach workers
from adaserve.gateway.errors import ApiError, declared
from adaserve.gateway.keys import ApiKey, AuthError
from adaserve.gateway.routes.deps import AuthorizationHeader, GatewayDep
from adaserve.gateway.service import Gateway
from adaserve.gateway.slo import class_feasibility

router = APIRouter(tags=["models"])


def _authorize(gw: Gateway, authorization: str | None) -> ApiKey | None:
    try:
        return gw.keys.authenticate(authorization)
    except AuthError as e:
        raise ApiError(401, str(e), code="invalid_api_key") from None


def may_read(key: ApiKey | None, record: dict[str, str]) -> bool:
    """A record is its own key's (and an admin key's); with keys off there is no one to tell apart."""
    return key is None or key.admin or record.get("api_key") == key.name


@router.get("/v1/models", responses=declared(401))
async def models(gw: GatewayDep, authorization: AuthorizationHeader = None) -> dict[str, Any]:
    _authorize(gw, authorization)
    names = [gw.settings.model_name] if gw.settings.model_name else gw.directory.models()
    now = int(time.time())
    return {"object": "list",
            "data": [{"id": n, "object": "model", "created": now, "owned_by": "adaserve"} for n in names]}


@router.get("/v1/slo-classes")
async def slo_classes(gw: GatewayDep) -> dict[str, Any]:
    """The classes a request may name (header ``X-SLO-Class`` or body ``slo_class``) and the default, each
    with how a lone request of it fares on the best usable worker (``feasibility``, ``lone_tpot_ms``; null
    until one reports)."""
    workers = gw.directory.usable()
    return {"default": gw.catalog.default,
            "data": [{**c.public(), **class_feasibility(c, workers, margin=gw.settings.slo_margin)}
                     for c in gw.catalog.classes.values()]}


@router.get("/v1/requests/{request_id}", responses=declared(400, 401, 404, 503))
async def request_record(request_id: Annotated[str, Path(pattern=REQUEST_ID_PATTERN)],
                         gw: GatewayDep, authorization: AuthorizationHeader = None) -> dict[str, Any]:
    """The request's record, to the API key that made it (or an admin key). Another key's record is 404, as an
    unknown one: its existence is not told either. Redis unreachable: 503 + Retry-After."""
    key = _authorize(gw, authorization)
    record = await gw.store.get_record(request_id)  # RedisError -> 503 (app.py)
    if record is None or not may_read(key, record):
        raise ApiError(404, f"no record of request {request_id!r} (unknown, expired, or another API key's)",
                       code="record_not_found")
    return record
