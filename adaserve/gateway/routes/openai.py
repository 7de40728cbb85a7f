"""``POST /v1/completions`` and ``POST /v1/chat/completions``, as OpenAI's API defines them (relay.py)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from adaserve.contract.openai import ChatRequest, CompletionRequest
from adaserve.gateway import relay
from adaserve.gateway.errors import declared
from adaserve.gateway.routes.deps import AuthorizationHeader, GatewayDep, SloClassHeader

router = APIRouter(tags=["openai"])

# 200: one JSON body, or server-sent events when the body asks to stream; before OpenAPI 3.2, an event stream's
# schema is each event's: ``data`` holds one chunk as JSON, or ``[DONE]``
EVENT = {"type": "object", "properties": {"data": {"type": "string"}}, "required": ["data"]}
RESPONSES = {200: {"content": {"text/event-stream": {"schema": EVENT}}},
             **declared(400, 401, 404, 413, 429, 502, 503)}


@router.post("/v1/completions", responses=RESPONSES)
async def completions(body: CompletionRequest, gw: GatewayDep, request: Request,
                      authorization: AuthorizationHeader = None, x_slo_class: SloClassHeader = None) -> Any:
    return await relay.serve(gw, "completion", body, request, authorization=authorization, header_class=x_slo_class)


@router.post("/v1/chat/completions", responses=RESPONSES)
async def chat_completions(body: ChatRequest, gw: GatewayDep, request: Request,
                           authorization: AuthorizationHeader = None, x_slo_class: SloClassHeader = None) -> Any:
    return await relay.serve(gw, "chat", body, request, authorization=authorization, header_class=x_slo_class)
