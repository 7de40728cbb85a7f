"""One OpenAI request from arrival to its last byte: who is calling, which class, rate limit, a worker's
stream, and the answer as server-sent events or one JSON body. The two endpoints differ only in shape.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from adaserve.contract.slo import FAILED_END
from adaserve.gateway import dispatch, openai_format
from adaserve.gateway.errors import ApiError, error_body
from adaserve.gateway.keys import AuthError
from adaserve.gateway.openai_format import Kind
from adaserve.gateway.openai_schemas import ChatRequest, CompletionRequest
from adaserve.gateway.service import Gateway
from adaserve.gateway.slo import UnknownClass
from adaserve.gateway.tracker import Tracker

DISCONNECT_POLL_S = 0.25


class Call:
    """What the handler knows about one request once it is admitted to a worker."""

    def __init__(self, gw: Gateway, kind: Kind, body: CompletionRequest | ChatRequest, track: Tracker,
                 up: dispatch.Upstream) -> None:
        self.gw, self.kind, self.body, self.track, self.up = gw, kind, body, track, up
        self.created = int(time.time())
        self.text: list[str] = []
        self.finish: str | None = None
        self.prompt_tokens = 0
        self.final: dict[str, Any] = {}
        self.outcome = "aborted"  # until the worker's final chunk says otherwise

    @property
    def rid(self) -> str:
        return self.track.request_id

    def chunk(self, **kw: Any) -> dict[str, Any]:
        return openai_format.stream_chunk(self.kind, rid=self.rid, model=self.body.model, created=self.created, **kw)

    async def chunks(self) -> AsyncIterator[dict[str, Any]]:
        """The worker's chunks, recorded as they pass; sets outcome and finish on the final one."""
        async for c in self.up.chunks():
            self.track.on_tokens(len(c.get("token_ids") or ()))
            yield c
            if "finish_reason" in c:
                self.final, self.prompt_tokens = c, int(c.get("prompt_tokens") or 0)
                reason = c["finish_reason"]
                if reason in FAILED_END:
                    self.outcome = "failed"
                    raise dispatch.WorkerLost(f"worker {self.up.worker.id} ended the request: {reason}")
                self.outcome, self.finish = "done", reason  # stop | length: the worker already speaks OpenAI's words

    async def end(self) -> None:
        """Release the worker, abort there if unfinished, write the record. Runs once, whatever happened."""
        if self.outcome == "aborted":
            await dispatch.abort(self.gw.http, self.up.worker, self.rid)
        await self.up.close()
        self.gw.done(self.up, self.track, self.outcome)
        met = await self.track.finished(self.outcome, self.finish)
        self.final["slo_met"] = met

    def extra(self) -> dict[str, Any]:
        return {**openai_format.slo_info(self.final, self.track.slo.name, met=self.final.get("slo_met")),
                "worker": self.up.worker.id}


async def serve(gw: Gateway, kind: Kind, body: CompletionRequest | ChatRequest, request: Request, *,
                authorization: str | None, header_class: str | None) -> Any:
    try:
        key = gw.keys.authenticate(authorization)
    except AuthError as e:
        raise ApiError(401, str(e), code="invalid_api_key") from None
    try:
        slo = gw.catalog.resolve(header=header_class, body=body.slo_class,
                                 key_default=key.default_class if key else None)
    except UnknownClass as e:
        raise ApiError(400, str(e), code="unknown_slo_class", param="slo_class") from None
    model = gw.check_model(body.model)
    rid = f"{'cmpl' if kind == 'completion' else 'chatcmpl'}-{uuid.uuid4().hex}"
    track = gw.tracker(rid, slo, key, model)
    await track.received()
    try:
        await gw.rate_limit(key)
    except ApiError:
        await track.refused("rate_limited", "rate_limit")
        raise
    up = await gw.open(body.generate_request(gw.settings.max_tokens_default, slo, rid), slo, track)
    call = Call(gw, kind, body, track, up)
    headers = {"X-Request-Id": rid, "X-SLO-Class": slo.name, "X-Adaserve-Worker": up.worker.id}
    if body.stream:
        return StreamingResponse(_sse(call), media_type="text/event-stream",
                                 headers={**headers, "Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    return JSONResponse(await _collect(call, request), headers=headers)


def _event(doc: dict[str, Any]) -> str:
    return f"data: {json.dumps(doc)}\n\n"


async def _sse(call: Call) -> AsyncIterator[str]:
    """Server-sent events. Tokens already sent cannot be taken back, so a worker lost mid-stream ends the
    stream with an error event that says so (the official client raises it as an APIError)."""
    try:
        if call.kind == "chat":
            yield _event(call.chunk(role=True, text=""))
        try:
            async for c in call.chunks():
                if c.get("text"):
                    yield _event(call.chunk(text=c["text"]))
        except dispatch.WorkerLost as e:
            call.outcome = "failed"
            yield _event(error_body(502, f"{e}; the output above is incomplete", code="worker_failed"))
        else:
            yield _event(call.chunk(finish=call.finish))
            if call.body.include_usage:
                yield _event(openai_format.usage_chunk(call.kind, rid=call.rid, model=call.body.model,
                                                       created=call.created, prompt_tokens=call.prompt_tokens,
                                                       completion_tokens=call.track.tokens))
        yield "data: [DONE]\n\n"
    finally:
        # a client that went away cancels this generator: clean up in a task of its own, not on the way out
        call.gw.spawn(call.end())


async def _collect(call: Call, request: Request) -> dict[str, Any]:
    async def gather() -> None:
        async for c in call.chunks():
            if c.get("text"):
                call.text.append(c["text"])

    task = asyncio.ensure_future(gather())
    try:
        while not task.done():
            await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if not task.done() and await request.is_disconnected():
                task.cancel()
        try:
            task.result()
        except asyncio.CancelledError:
            raise ApiError(499, "client closed the request") from None
        except dispatch.WorkerLost as e:
            call.outcome = "failed"
            raise ApiError(502, str(e), code="worker_failed") from None
    finally:
        if not task.done():
            task.cancel()
        await call.end()
    return openai_format.full_response(call.kind, rid=call.rid, model=call.body.model, created=call.created,
                                       text="".join(call.text), finish=call.finish,
                                       prompt_tokens=call.prompt_tokens, completion_tokens=call.track.tokens,
                                       extra=call.extra())
