"""dispatch.py: a worker's stream over a fake transport, and the two silence limits.

first_token_timeout_s bounds the wait for the first token (WorkerFailed: another worker may be tried);
token_timeout_s bounds the silence between any two chunks after it (WorkerLost: the answer is incomplete).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from adaserve.contract.generate import GenerateRequest
from adaserve.gateway import dispatch
from tests.gateway.unit.helpers import run, view

STALL = "stall"  # in a script: the worker goes silent (the connection stays open)


class Script(httpx.AsyncByteStream):
    """A worker's SSE body: chunks (dicts), pauses (seconds) and STALL, in order."""

    def __init__(self, steps: list[dict[str, Any] | float | str]) -> None:
        self.steps = steps

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for step in self.steps:
            if step == STALL:
                await asyncio.sleep(3600)
            elif isinstance(step, (int, float)):
                await asyncio.sleep(step)
            else:
                yield f"data: {json.dumps(step)}\n\n".encode()


def token(i: int) -> dict[str, Any]:
    return {"token_ids": [i], "text": f"t{i}"}


FINAL = {"token_ids": [9], "text": "t9", "finish_reason": "length", "prompt_tokens": 3}


async def read(steps: list[dict[str, Any] | float | str], *, first_token_timeout_s: float = 5.0,
               token_timeout_s: float = 0.2) -> tuple[list[dict[str, Any]], BaseException | None, float]:
    """Open the stream and read it to the end: the chunks, the exception that ended it (if any), seconds taken."""

    async def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, stream=Script(steps), headers={"content-type": "text/event-stream"})

    got: list[dict[str, Any]] = []
    error: BaseException | None = None
    start = time.monotonic()
    async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
        try:
            up = await dispatch.open_stream(client, view("w"), GenerateRequest(request_id="r1", prompt="x"),
                                            first_token_timeout_s=first_token_timeout_s,
                                            token_timeout_s=token_timeout_s)
            try:
                async for chunk in up.chunks():
                    got.append(chunk)
            finally:
                await up.close()
        except (dispatch.WorkerFailed, dispatch.WorkerLost) as e:
            error = e
    return got, error, time.monotonic() - start


def test_the_request_is_posted_as_a_stream_without_empty_fields() -> None:
    posted: list[dict[str, Any]] = []

    async def handler(request: httpx.Request) -> httpx.Response:
        posted.append(json.loads(request.content))
        return httpx.Response(200, stream=Script([FINAL]), headers={"content-type": "text/event-stream"})

    async def main() -> None:
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            up = await dispatch.open_stream(client, view("w"), GenerateRequest(request_id="r1", prompt="x"),
                                            first_token_timeout_s=5.0, token_timeout_s=1.0)
            await up.close()

    run(main())
    (body,) = posted
    assert body["stream"] is True and "seed" not in body and "slo_class" not in body  # None: the worker's default
    assert GenerateRequest.model_validate(body) == GenerateRequest(request_id="r1", prompt="x", stream=True)


def test_a_whole_stream_is_read() -> None:
    got, error, _ = run(read([token(1), token(2), FINAL]))
    assert error is None
    assert [c["text"] for c in got] == ["t1", "t2", "t9"]


def test_a_worker_silent_mid_stream_is_lost_after_token_timeout_s() -> None:
    # first_token_timeout_s (5 s) is far longer: the silence after the first token must not wait for it
    got, error, elapsed = run(read([token(1), token(2), STALL], first_token_timeout_s=5.0, token_timeout_s=0.2))
    assert isinstance(error, dispatch.WorkerLost)
    assert "sent nothing for 0.2s" in str(error)
    assert [c["text"] for c in got] == ["t1", "t2"]
    assert 0.18 <= elapsed < 2.0


def test_token_timeout_s_limits_each_gap_not_the_whole_stream() -> None:
    # five gaps of 0.1 s: 0.5 s in all, more than token_timeout_s, but no single gap reaches it
    steps: list[dict[str, Any] | float | str] = [token(1)]
    for i in range(2, 6):
        steps += [0.1, token(i)]
    got, error, elapsed = run(read([*steps, 0.1, FINAL], token_timeout_s=0.3))
    assert error is None
    assert len(got) == 6 and got[-1]["finish_reason"] == "length"
    assert elapsed >= 0.45


def test_a_worker_silent_before_the_first_token_fails_after_first_token_timeout_s() -> None:
    got, error, elapsed = run(read([STALL], first_token_timeout_s=0.3, token_timeout_s=0.05))
    assert isinstance(error, dispatch.WorkerFailed)  # nothing sent yet: another worker may be tried
    assert got == []
    assert 0.28 <= elapsed < 2.0


def test_a_stream_that_ends_before_the_final_chunk_is_lost() -> None:
    got, error, _ = run(read([token(1), token(2)]))
    assert isinstance(error, dispatch.WorkerLost) and "closed the stream" in str(error)
    assert len(got) == 2


@pytest.mark.parametrize("first", [FINAL, {"token_ids": [], "finish_reason": "abort"}])
def test_a_final_first_chunk(first: dict[str, Any]) -> None:
    got, error, _ = run(read([first]))
    if first["finish_reason"] == "abort":  # aborted before any token (a draining worker): try elsewhere
        assert isinstance(error, dispatch.WorkerFailed) and got == []
    else:
        assert error is None and got == [FINAL]
