"""``GET /metrics``: the gateway's Prometheus registry."""

from __future__ import annotations

from fastapi import APIRouter, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from adaserve.gateway.routes.deps import GatewayDep

router = APIRouter(tags=["metrics"])


@router.get("/metrics")
async def metrics(gw: GatewayDep) -> Response:
    return Response(generate_latest(gw.metrics.registry), media_type=CONTENT_TYPE_LATEST)
