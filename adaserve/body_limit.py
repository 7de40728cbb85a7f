"""A request body size limit for the worker and the gateway, enforced before the body is read in full.

Without it a 20 MB prompt was read, parsed and tokenised before anything refused it (37 s, and gigabytes of
worker memory that stayed taken). ``BodyLimit`` is plain ASGI middleware, outermost, so nothing behind it
buffers the body first: a declared ``Content-Length`` over the limit is answered 413 before a byte is read;
a body without one (chunked) is counted as it streams in, and the read that crosses the limit raises
``BodyTooLarge`` (FastAPI's HTTPException, which FastAPI passes on from a body read where it would turn any other
error into a 400, so the app's own handler renders it in the app's error shape).

uvicorn discards whatever the client still sends after the answer and keeps the connection, so a client
that writes the whole body before reading (most do) gets the 413, not a reset.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from fastapi import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024  # a full context of token ids is well under 1 MB


class BodyTooLarge(HTTPException):
    def __init__(self, limit: int, *, declared: int | None = None) -> None:
        size = f"{declared} bytes" if declared is not None else "more"
        super().__init__(413, f"request body too large: {size}, the limit is {limit} bytes")
        self.limit = limit


def _declared_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


class BodyLimit:
    """``render(error)``: the 413's JSON body in the app's shape (OpenAI's at the gateway)."""

    def __init__(self, app: ASGIApp, *, max_bytes: int, render: Callable[[BodyTooLarge], dict[str, Any]]) -> None:
        self.app, self.max_bytes, self.render = app, max_bytes, render

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _declared_length(scope)
        if declared is not None and declared > self.max_bytes:
            await self._refuse(send, BodyTooLarge(self.max_bytes, declared=declared))
            return
        seen = 0
        started = False

        async def counted() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise BodyTooLarge(self.max_bytes)
            return message

        async def watched(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counted, watched)
        except BodyTooLarge as e:  # raised outside the app's handlers (a route that reads the body itself)
            if started:
                raise
            await self._refuse(send, e)

    async def _refuse(self, send: Send, error: BodyTooLarge) -> None:
        body = json.dumps(self.render(error)).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})
