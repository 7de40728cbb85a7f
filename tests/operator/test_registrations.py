"""Reading registrations from a real Redis (tests/redis_prefix.py), and not waiting on an unreachable one, but
saying why (host and error, never the password)."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio
import redis.asyncio as aioredis

from adaserve.contract.registry import index_key, worker_key
from adaserve.operator.registrations import WorkersRead, describe_failure, read_workers
from tests.redis_prefix import REDIS_URL, isolated_aredis


@pytest_asyncio.fixture
async def redis_prefix() -> AsyncIterator[tuple[aioredis.Redis, str]]:
    async with isolated_aredis("operator") as (client, prefix):
        yield client, prefix


@pytest.mark.asyncio
async def test_live_registrations_are_read(redis_prefix: tuple[aioredis.Redis, str]) -> None:
    r, prefix = redis_prefix
    now_ms = int(time.time() * 1000)
    for wid, expires, budget in (("w-1", now_ms + 60_000, 128), ("w-0", now_ms + 60_000, None),
                                 ("gone", now_ms - 1_000, 64)):
        await r.set(worker_key(prefix, wid), json.dumps(
            {"worker_id": wid, "address": f"http://{wid}:8000", "status": "ready", "device": "cpu",
             "budget": budget}), px=60_000)
        await r.zadd(index_key(prefix), {wid: expires})
    await r.zadd(index_key(prefix), {"crashed": now_ms + 60_000})  # in the index, entry already expired
    assert await read_workers(REDIS_URL, prefix, timeout_s=2) == WorkersRead([
        {"id": "w-0", "address": "http://w-0:8000", "device": "cpu", "budget": None, "status": "ready"},
        {"id": "w-1", "address": "http://w-1:8000", "device": "cpu", "budget": 128, "status": "ready"},
    ])


@pytest.mark.asyncio
async def test_no_workers_yet(redis_prefix: tuple[aioredis.Redis, str]) -> None:
    assert await read_workers(REDIS_URL, redis_prefix[1], timeout_s=2) == WorkersRead([], None)


@pytest.mark.asyncio
async def test_unreachable_redis_is_no_exception_quick_and_explained() -> None:
    started = time.monotonic()
    # nothing listens on port 1; a name that does not resolve behaves the same
    refused = await read_workers("redis://:s3cret@127.0.0.1:1/0", "p", timeout_s=0.5)
    unknown = await read_workers("redis://no-such-host.invalid:6379/0", "p", timeout_s=0.5)
    assert time.monotonic() - started < 10
    assert refused.workers is None and unknown.workers is None
    assert refused.error is not None and refused.error.startswith("Redis at 127.0.0.1:1: ")
    assert "s3cret" not in refused.error
    assert len(refused.error) > len("Redis at 127.0.0.1:1: ")  # the driver's reason, not just the place
    assert unknown.error is not None and unknown.error.startswith("Redis at no-such-host.invalid:6379: ")


def test_failure_text_hides_the_password_and_bounds_the_length() -> None:
    url = "rediss://admin:hunter2@redis.example/3"
    said = describe_failure(url, ConnectionError(f"cannot AUTH hunter2 at {url}"), timeout_s=1)
    assert said == "Redis at redis.example:6379: cannot AUTH *** at rediss://admin:***@redis.example/3"
    assert describe_failure("redis://r:7000/0", TimeoutError(), timeout_s=2) == (
        "Redis at r:7000: TimeoutError after 2 s")  # asyncio's timeout has no text of its own
    assert describe_failure("unix:///run/redis.sock", OSError("gone"), timeout_s=1) == "Redis at /run/redis.sock: gone"
    assert len(describe_failure("redis://r/0", OSError("x" * 1000), timeout_s=1)) < 350
