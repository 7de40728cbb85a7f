"""``GET /healthz`` (the process can serve, or will once loaded) and ``GET /readyz`` (send it traffic)."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse

from adaserve.worker.routes.deps import RuntimeDep

router = APIRouter(tags=["health"])


@router.get("/healthz")
async def healthz(runtime: RuntimeDep) -> JSONResponse:
    body = {"status": runtime.state.value, "error": runtime.failure}
    return JSONResponse(body, status_code=200 if runtime.live else 503)


@router.get("/readyz")
async def readyz(runtime: RuntimeDep) -> JSONResponse:
    body = {"status": runtime.state.value, "active_requests": len(runtime.active)}
    return JSONResponse(body, status_code=200 if runtime.ready else 503)
