"""Where registrations live in Redis, and the one function that reads the live ones.

    {prefix}:workers:{worker_id}   STRING  a registration (registration.py) as JSON; expires after its TTL
    {prefix}:workers               ZSET    member worker_id, score = when its entry expires (unix ms)

The worker writes both at every heartbeat (adaserve/worker/registry.py); the gateway and the operator read
them with ``read_registrations``, which takes the caller's client: this module needs no Redis driver.
"""

from __future__ import annotations

import json
import time
from collections.abc import Awaitable
from typing import Any, Protocol

from adaserve.contract.registration import Registration, parse_registration


def worker_key(prefix: str, worker_id: str) -> str:
    return f"{prefix}:workers:{worker_id}"


def index_key(prefix: str) -> str:
    return f"{prefix}:workers"


class RegistryClient(Protocol):
    """The two reads of ``redis.asyncio.Redis`` used here; a client with or without decode_responses."""

    def zrangebyscore(self, name: str, min: str, max: str) -> Awaitable[Any]: ...

    def mget(self, keys: list[str]) -> Awaitable[Any]: ...


async def read_registrations(client: RegistryClient, prefix: str) -> list[Registration]:
    """The live workers: ids whose expiry in the index is still ahead, then their entries with one MGET.

    An entry that expired between the two reads, or is not a registration, is left out. The client's
    errors (RedisError, OSError, timeouts) are the caller's: each reader reports an outage its own way.
    """
    now_ms = int(time.time() * 1000)
    ids = await client.zrangebyscore(index_key(prefix), f"({now_ms}", "+inf")
    if not ids:
        return []
    raw = await client.mget([worker_key(prefix, i.decode() if isinstance(i, bytes) else str(i)) for i in ids])
    out = []
    for body in raw:
        if body is None:  # expired between the two reads
            continue
        try:
            doc = json.loads(body)
        except ValueError:
            continue
        reg = parse_registration(doc)
        if reg is not None:
            out.append(reg)
    return out
