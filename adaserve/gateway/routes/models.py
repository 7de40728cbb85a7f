"""``GET /v1/models``, ``GET /v1/slo-classes`` and ``GET /v1/requests/{id}`` (a request's record)."""

from __future__ import annotations

import time
from typing import Annotated, Any

from fastapi import APIRouter, Path

from adaserve.contract.generate import REQUEST_ID_PATTERN  # one id syntax: the gateway's ids reach workers
from adaserve.gateway.errors import ApiError
from adaserve.gateway.keys import AuthError
from adaserve.gateway.routes.deps import AuthorizationHeader, GatewayDep
from adaserve.gateway.service import Gateway
from adaserve.gateway.slo import class_feasibility

router = APIRouter(tags=["models"])


def _authorize(gw: Gateway, authorization: str | None) -> None:
    try:
        gw.keys.authenticate(authorization)
    except AuthError as e:
        raise ApiError(401, str(e), code="invalid_api_key") from None


@router.get("/v1/models")
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


@router.get("/v1/requests/{request_id}")
async def request_record(request_id: Annotated[str, Path(pattern=REQUEST_ID_PATTERN)],
                         gw: GatewayDep, authorization: AuthorizationHeader = None) -> dict[str, Any]:
    _authorize(gw, authorization)
    record = await gw.store.get_record(request_id)
    if record is None:
        raise ApiError(404, f"no record of request {request_id!r} (unknown or expired)")
    return record
