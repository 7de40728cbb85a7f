"""``DELETE /v1/requests/{request_id}``: abort a request in flight; its KV is freed before the next step."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, HTTPException, Path

from adaserve.contract.generate import REQUEST_ID_PATTERN
from adaserve.worker.routes.deps import RuntimeDep

router = APIRouter(tags=["requests"])

RequestIdPath = Annotated[str, Path(pattern=REQUEST_ID_PATTERN)]


@router.delete("/v1/requests/{request_id}")
async def abort(request_id: RequestIdPath, runtime: RuntimeDep) -> dict[str, Any]:
    if not runtime.abort(request_id):
        raise HTTPException(404, f"request_id {request_id!r} is not in flight")
    return {"id": request_id, "aborted": True}
