"""``GET /metrics``: the worker's Prometheus registry in the text exposition format."""

from __future__ import annotations

from fastapi import APIRouter, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from adaserve.worker.routes.deps import RuntimeDep

router = APIRouter(tags=["metrics"])


@router.get("/metrics")
async def metrics(runtime: RuntimeDep) -> Response:
    return Response(generate_latest(runtime.metrics.registry), media_type=CONTENT_TYPE_LATEST)
