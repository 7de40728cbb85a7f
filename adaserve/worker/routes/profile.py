"""``GET /v1/profile`` (budget, cost model, device) and ``GET /v1/status`` (the registration document)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from adaserve.worker.routes.deps import RuntimeDep
from adaserve.worker.runtime import RequestRefused

router = APIRouter(tags=["profile"])


@router.get("/v1/profile")
async def profile(runtime: RuntimeDep) -> dict[str, Any]:
    if runtime.built is None:
        raise RequestRefused(503, f"worker is {runtime.state.value}: no profile yet",
                             retry_after=runtime.settings.retry_after_s)
    return runtime.profile().model_dump(mode="json")


@router.get("/v1/status")
async def status(runtime: RuntimeDep) -> dict[str, Any]:
    """The registration document (docs/worker.md), also without Redis: a gateway given worker URLs polls this."""
    return runtime.registration().document()
