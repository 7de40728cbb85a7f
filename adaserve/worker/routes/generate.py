"""``POST /v1/generate``: one completion, streamed as server-sent events or returned as one JSON body.

SSE: ``data: {chunk}`` per engine event (token ids and the text delta), a final chunk with
``finish_reason`` and metrics, then ``data: [DONE]``. A client that goes away has its request aborted.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Annotated, Any

from fastapi import APIRouter, Header, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.background import BackgroundTask

from adaserve.contract.generate import GenerateRequest
from adaserve.contract.slo import CLASS_NAME
from adaserve.worker import stream
from adaserve.worker.routes.deps import RuntimeDep
from adaserve.worker.runtime import InFlight, Runtime

router = APIRouter(tags=["generate"])

SloClassHeader = Annotated[str | None, Header(alias="X-SLO-Class", pattern=CLASS_NAME.pattern)]

DISCONNECT_POLL_S = 0.25


@router.post("/v1/generate")
async def generate(body: GenerateRequest, runtime: RuntimeDep, request: Request,
                   x_slo_class: SloClassHeader = None) -> Any:
    flight = await runtime.submit(body, header_class=x_slo_class)
    headers = {"X-Request-Id": flight.request_id}
    if body.stream:
        return StreamingResponse(
            _sse(runtime, flight), media_type="text/event-stream",
            headers={**headers, "Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            # runs after the stream ends or the client disconnects, even if the body never started
            background=BackgroundTask(abort_unfinished, runtime, flight),
        )
    return JSONResponse(await wait_whole(runtime, flight, request), headers=headers)


async def _sse(runtime: Runtime, flight: InFlight) -> AsyncIterator[str]:
    try:
        async for chunk in stream.chunks(runtime, flight):
            yield f"data: {json.dumps(chunk)}\n\n"
        yield "data: [DONE]\n\n"
    finally:
        abort_unfinished(runtime, flight)


async def wait_whole(runtime: Runtime, flight: InFlight, request: Request) -> dict[str, Any]:
    """The whole answer, aborting the request if the client disconnects while it waits."""
    task = asyncio.ensure_future(stream.collect(runtime, flight))
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await request.is_disconnected():
                runtime.abort(flight.request_id)
                return await task  # the abort event arrives within a step
    finally:
        abort_unfinished(runtime, flight)
        if not task.done():
            task.cancel()


def abort_unfinished(runtime: Runtime, flight: InFlight) -> None:
    if not flight.done:
        runtime.abort(flight.request_id)
