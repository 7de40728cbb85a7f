"""``GET /metrics``: the gateway's Prometheus registry."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import PlainTextResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from adaserve.gateway.routes.deps import GatewayDep

router = APIRouter(tags=["metrics"])


@router.get("/metrics", response_class=PlainTextResponse,
            responses={200: {"description": "Prometheus text format", "content": {"text/plain": {}}}})
async def metrics(gw: GatewayDep) -> PlainTextResponse:
    return PlainTextResponse(generate_latest(gw.metrics.registry), media_type=CONTENT_TYPE_LATEST)
