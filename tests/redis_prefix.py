"""A key prefix of its own in the test Redis for each test, every key under it deleted afterwards.

The Redis is ``$ADASERVE_TEST_REDIS_URL`` (default ``redis://127.0.0.1:6379/0``); tests that cannot run
without one call ``require_redis`` and skip.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import AsyncIterator, Iterator

import pytest
import redis
import redis.asyncio as aioredis

REDIS_URL = os.environ.get("ADASERVE_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")


def require_redis() -> None:
    client = redis.Redis.from_url(REDIS_URL, socket_connect_timeout=1)
    try:
        client.ping()
    except redis.ConnectionError:
        pytest.skip(f"no Redis at {REDIS_URL}")
    finally:
        client.close()


def new_prefix(label: str) -> str:
    """Unique per call: tests running at once never see each other's keys."""
    return f"adaserve-test-{label}-{uuid.uuid4().hex[:12]}"


def isolated_redis(label: str) -> Iterator[tuple[redis.Redis, str]]:
    """For a fixture: a text client and a fresh prefix; skips without Redis."""
    require_redis()
    client = redis.Redis.from_url(REDIS_URL, decode_responses=True)
    prefix = new_prefix(label)
    try:
        yield client, prefix
    finally:
        keys = list(client.scan_iter(f"{prefix}:*"))
        if keys:
            client.delete(*keys)
        client.close()


@contextlib.asynccontextmanager
async def isolated_aredis(label: str, *, decode_responses: bool = True) -> AsyncIterator[tuple[aioredis.Redis, str]]:
    """The same for async tests (call ``require_redis`` first to skip rather than fail without Redis)."""
    prefix = new_prefix(label)
    client = aioredis.from_url(REDIS_URL, decode_responses=decode_responses)
    try:
        yield client, prefix
    finally:
        keys = [k async for k in client.scan_iter(match=f"{prefix}:*")]
        if keys:
            await client.delete(*keys)
        await client.aclose()
