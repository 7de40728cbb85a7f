"""Reading the workers' registrations from Redis, briefly: the status must never wait on a slow Redis.

Key schema: adaserve/worker/registry.py (live ids from the index ZSET, then MGET of their entries).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from adaserve.operator.status import parse_registrations
from adaserve.worker.registry import index_key, redacted, worker_key

log = logging.getLogger(__name__)


async def read_workers(url: str, prefix: str, *, timeout_s: float) -> list[dict[str, Any]] | None:
    """status.workers entries of the live workers; None (logged at debug) when Redis cannot be read in time.

    Unreachable Redis is normal while a managed one starts (and its DNS name only resolves in-cluster),
    so it is no error: the status just has no worker details.
    """
    client = aioredis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
    now_ms = int(time.time() * 1000)
    try:
        async with asyncio.timeout(2 * timeout_s):  # both calls together, whatever the retries inside
            ids = await client.zrangebyscore(index_key(prefix), f"({now_ms}", "+inf")
            if not ids:
                return []
            keys = [worker_key(prefix, i.decode() if isinstance(i, bytes) else str(i)) for i in ids]
            raw = await client.mget(keys)
    except (RedisError, OSError, TimeoutError) as e:
        log.debug("cannot read registrations from %s: %s", redacted(url), e)
        return None
    finally:
        await client.aclose()
    return parse_registrations(raw)
