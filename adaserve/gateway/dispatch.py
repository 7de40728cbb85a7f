"""Talking to one worker: open its token stream, read chunks, abort.

Always streams from the worker, even for a client that wants one JSON body: the gateway must see the
first token to know whether a retry on another worker is still safe (nothing sent to the client yet)
and to measure TTFT where the client sees it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx

from adaserve.contract.generate import GenerateRequest
from adaserve.contract.slo import FAILED_END
from adaserve.gateway.errors import ApiError
from adaserve.gateway.view import WorkerView


class WorkerFailed(Exception):
    """The worker could not start the request: retrying elsewhere is safe. ``busy``: it said 503."""

    def __init__(self, message: str, *, busy: bool = False) -> None:
        super().__init__(message)
        self.busy = busy


class WorkerLost(Exception):
    """The worker failed after its first token: the answer goes on on another worker (relay.Call, failover.py),
    or, when none can take it on, is incomplete."""


async def _events(response: httpx.Response) -> AsyncIterator[dict[str, Any]]:
    async for line in response.aiter_lines():
        if not line.startswith("data: "):
            continue
        data = line[len("data: "):]
        if data == "[DONE]":
            return
        yield json.loads(data)


def _detail(body: bytes) -> str:
    try:
        doc = json.loads(body)
        return str(doc.get("detail") or doc)
    except (ValueError, AttributeError):
        return body.decode(errors="replace")[:500]


@dataclass
class Upstream:
    """A worker's stream whose first token (or final chunk) has arrived."""

    worker: WorkerView
    response: httpx.Response
    events: AsyncIterator[dict[str, Any]]
    first: dict[str, Any]
    token_timeout_s: float  # the longest the worker may stay silent between two chunks

    async def chunks(self) -> AsyncIterator[dict[str, Any]]:
        """Every chunk from the first; WorkerLost if the stream breaks, or the worker is silent for longer
        than ``token_timeout_s``, before the final chunk."""
        yield self.first
        if "finish_reason" in self.first:
            return
        while True:
            try:
                async with asyncio.timeout(self.token_timeout_s):  # around the read only, never the yield
                    chunk = await anext(self.events)
            except StopAsyncIteration:
                break
            except TimeoutError:
                raise WorkerLost(f"worker {self.worker.id} sent nothing for {self.token_timeout_s:g}s "
                                 "mid-stream") from None
            except (httpx.HTTPError, json.JSONDecodeError) as e:
                raise WorkerLost(f"worker {self.worker.id} failed mid-stream: {type(e).__name__}: {e}") from None
            yield chunk
            if "finish_reason" in chunk:
                return
        raise WorkerLost(f"worker {self.worker.id} closed the stream before the last token")

    async def close(self) -> None:
        await self.response.aclose()


async def open_stream(client: httpx.AsyncClient, worker: WorkerView, request: GenerateRequest, *,
                      first_token_timeout_s: float, token_timeout_s: float) -> Upstream:
    """POST ``request`` (to stream) to the worker's /v1/generate and wait for the first token.

    Raises WorkerFailed when another worker should be tried, ApiError when the request itself is at
    fault (the worker's 4xx, passed on).
    """
    payload = {**request.model_dump(mode="json", exclude_none=True), "stream": True}
    try:
        response = await client.send(client.build_request("POST", f"{worker.address}/v1/generate", json=payload),
                                     stream=True)
    except httpx.HTTPError as e:
        raise WorkerFailed(f"worker {worker.id} unreachable: {type(e).__name__}: {e}") from None
    if response.status_code != 200:
        body = await response.aread()
        await response.aclose()
        if response.status_code >= 500:
            raise WorkerFailed(f"worker {worker.id} answered {response.status_code}: {_detail(body)}",
                               busy=response.status_code == 503)
        status = 400 if response.status_code == 422 else response.status_code
        raise ApiError(status, _detail(body), code="rejected_by_worker")
    events = _events(response)
    try:
        async with asyncio.timeout(first_token_timeout_s):
            async for chunk in events:
                final = "finish_reason" in chunk
                if final and not chunk.get("token_ids") and chunk["finish_reason"] in FAILED_END:
                    break  # aborted before producing anything (the worker drained): try elsewhere
                if chunk.get("token_ids") or final:
                    return Upstream(worker, response, events, chunk, token_timeout_s)
    except (httpx.HTTPError, json.JSONDecodeError, TimeoutError) as e:
        await response.aclose()
        raise WorkerFailed(f"worker {worker.id} failed before the first token: {type(e).__name__}: {e}") from None
    await response.aclose()
    raise WorkerFailed(f"worker {worker.id} ended the request before the first token")


async def abort(client: httpx.AsyncClient, worker: WorkerView, request_id: str) -> None:
    """Best effort: the worker also aborts when our connection closes; this makes it immediate."""
    with contextlib.suppress(httpx.HTTPError):
        await client.delete(f"{worker.address}/v1/requests/{request_id}", timeout=2.0)
