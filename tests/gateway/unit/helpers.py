"""Shared pieces of the gateway's unit tests: running coroutines, worker views, and the two state stores."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Coroutine
from typing import Any, TypeVar

from adaserve.gateway.redis_state import RedisStore
from adaserve.gateway.state import MemoryStore, StateStore
from adaserve.gateway.view import WorkerView
from tests.redis_prefix import isolated_aredis

T = TypeVar("T")

STORES = ("memory", "redis")


def run(coro: Coroutine[Any, Any, T]) -> T:
    """The tests are plain functions (pytest-asyncio is not a declared dependency): one event loop each."""
    return asyncio.run(coro)


def view(id: str = "w", **kw: Any) -> WorkerView:
    """A ready worker of model ``m``; keyword arguments override any field."""
    fields: dict[str, Any] = {"id": id, "address": f"http://{id}", "status": "ready", "model": "m", "max_active": 8,
                              "active": 0}
    return WorkerView(**{**fields, **kw})


@contextlib.asynccontextmanager
async def open_store(kind: str) -> AsyncIterator[StateStore]:
    """``memory`` or ``redis`` (its own prefix, cleaned up): the same interface, for one test body."""
    if kind == "memory":
        yield MemoryStore()
        return
    async with isolated_aredis("gw") as (client, prefix):
        yield RedisStore(client, prefix)
