"""``GET /healthz`` (the process serves) and ``GET /readyz`` (state store reachable, some worker ready)."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse

from adaserve.gateway.routes.deps import GatewayDep

router = APIRouter(tags=["health"])


@router.get("/healthz")
async def healthz() -> dict[str, str]:
    return {"status": "ok"}


@router.get("/readyz", responses={503: {"description": "the state store is unreachable or no worker is ready "
                                                    "(the same body as 200)"}})
async def readyz(gw: GatewayDep) -> JSONResponse:
    store_ok = await gw.store.ping()
    workers = gw.directory.usable()
    body = {"state_store": "ok" if store_ok else "unreachable", "ready_workers": len(workers),
            "workers": [{"id": w.id, "address": w.address, "active": w.active} for w in workers],
            "registry_error": gw.directory.last_error}
    return JSONResponse(body, status_code=200 if store_ok and workers else 503)
