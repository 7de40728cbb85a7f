"""Reading registrations from a real Redis (127.0.0.1:6379), and not waiting on an unreachable one."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio
import redis.asyncio as aioredis

from adaserve.operator.registrations import read_workers

REDIS_URL = "redis://127.0.0.1:6379/0"


@pytest_asyncio.fixture
async def prefix() -> AsyncIterator[str]:
    p = f"adaserve-test:{uuid.uuid4().hex[:8]}:llama"  # a fresh prefix: parallel runs never see each other
    yield p
    r = aioredis.from_url(REDIS_URL)
    keys = [k async for k in r.scan_iter(f"{p}:*")]
    if keys:
        await r.delete(*keys)
    await r.aclose()


@pytest.mark.asyncio
async def test_live_registrations_are_read(prefix: str) -> None:
    r = aioredis.from_url(REDIS_URL)
    now_ms = int(time.time() * 1000)
    for wid, expires, budget in (("w-1", now_ms + 60_000, 128), ("w-0", now_ms + 60_000, None),
                                 ("gone", now_ms - 1_000, 64)):
        await r.set(f"{prefix}:workers:{wid}", json.dumps(
            {"worker_id": wid, "address": f"http://{wid}:8000", "status": "ready", "device": "cpu",
             "budget": budget}), px=60_000)
        await r.zadd(f"{prefix}:workers", {wid: expires})
    await r.zadd(f"{prefix}:workers", {"crashed": now_ms + 60_000})  # in the index, entry already expired
    await r.aclose()
    assert await read_workers(REDIS_URL, prefix, timeout_s=2) == [
        {"id": "w-0", "address": "http://w-0:8000", "device": "cpu", "budget": None, "status": "ready"},
        {"id": "w-1", "address": "http://w-1:8000", "device": "cpu", "budget": 128, "status": "ready"},
    ]


@pytest.mark.asyncio
async def test_no_workers_yet(prefix: str) -> None:
    assert await read_workers(REDIS_URL, prefix, timeout_s=2) == []


@pytest.mark.asyncio
async def test_unreachable_redis_is_no_error_and_quick() -> None:
    started = time.monotonic()
    # nothing listens on port 1; a name that does not resolve behaves the same
    assert await read_workers("redis://127.0.0.1:1/0", "p", timeout_s=0.5) is None
    assert await read_workers("redis://no-such-host.invalid:6379/0", "p", timeout_s=0.5) is None
    assert time.monotonic() - started < 10
