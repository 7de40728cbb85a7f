"""``POST /v1/completions`` and ``POST /v1/chat/completions``, as OpenAI's API defines them (relay.py)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from adaserve.gateway import relay
from adaserve.gateway.openai_schemas import ChatRequest, CompletionRequest
from adaserve.gateway.routes.deps import AuthorizationHeader, GatewayDep, SloClassHeader

router = APIRouter(tags=["openai"])


@router.post("/v1/completions")
async def completions(body: CompletionRequest, gw: GatewayDep, request: Request,
                      authorization: AuthorizationHeader = None, x_slo_class: SloClassHeader = None) -> Any:
    return await relay.serve(gw, "completion", body, request, authorization=authorization, header_class=x_slo_class)


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatRequest, gw: GatewayDep, request: Request,
                           authorization: AuthorizationHeader = None, x_slo_class: SloClassHeader = None) -> Any:
    return await relay.serve(gw, "chat", body, request, authorization=authorization, header_class=x_slo_class)
