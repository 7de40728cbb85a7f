"""Shared pieces of the gateway's unit tests: running coroutines, worker views, and the two state stores."""

from __future__ import annotations

import asyncio
import contextlib
import os
import uuid
from collections.abc import AsyncIterator, Coroutine
from typing import Any, TypeVar

import pytest
import redis
import redis.asyncio as aioredis

from adaserve.gateway.redis_state import RedisStore
from adaserve.gateway.routing import WorkerView
from adaserve.gateway.state import MemoryStore, StateStore

T = TypeVar("T")

REDIS_URL = os.environ.get("ADASERVE_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
STORES = ("memory", "redis")


def run(coro: Coroutine[Any, Any, T]) -> T:
    """The tests are plain functions (pytest-asyncio is not a declared dependency): one event loop each."""
    return asyncio.run(coro)


def view(id: str = "w", **kw: Any) -> WorkerView:
    """A ready worker of model ``m``; keyword arguments override any field."""
    fields: dict[str, Any] = {"id": id, "address": f"http://{id}", "status": "ready", "model": "m", "max_active": 8,
                              "active": 0}
    return WorkerView(**{**fields, **kw})


def require_redis() -> None:
    client = redis.Redis.from_url(REDIS_URL, socket_connect_timeout=1)
    try:
        client.ping()
    except redis.ConnectionError:
        pytest.skip(f"no Redis at {REDIS_URL}")
    finally:
        client.close()


def new_prefix() -> str:
    return f"adaserve-test-gw-{uuid.uuid4().hex[:12]}"


@contextlib.asynccontextmanager
async def redis_client() -> AsyncIterator[tuple[aioredis.Redis, str]]:
    """A client and a fresh key prefix; every key under the prefix is deleted afterwards."""
    prefix = new_prefix()
    client = aioredis.from_url(REDIS_URL, decode_responses=True)
    try:
        yield client, prefix
    finally:
        keys = [k async for k in client.scan_iter(match=f"{prefix}:*")]
        if keys:
            await client.delete(*keys)
        await client.aclose()


@contextlib.asynccontextmanager
async def open_store(kind: str) -> AsyncIterator[StateStore]:
    """``memory`` or ``redis`` (its own prefix, cleaned up): the same interface, for one test body."""
    if kind == "memory":
        yield MemoryStore()
        return
    async with redis_client() as (client, prefix):
        yield RedisStore(client, prefix)
