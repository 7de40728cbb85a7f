"""The worker's registration in Redis: a JSON entry with a TTL, refreshed by a heartbeat.

Schema (docs/worker.md has the fields):

    {prefix}:workers:{worker_id}   STRING  JSON registration, expires after registration_ttl_s
    {prefix}:workers               ZSET    member worker_id, score = when its entry expires (unix ms)

A gateway lists live workers with ``ZRANGEBYSCORE {prefix}:workers (now_ms +inf`` and reads their
entries with MGET; a worker that crashed drops out when its TTL passes. Each heartbeat also prunes
index members whose entries have already expired.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from adaserve.worker.settings import WorkerSettings

log = logging.getLogger(__name__)


def redacted(url: str) -> str:
    """The URL without its password, for logs."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.hostname or ""
    netloc = f"{parts.username or ''}:***@{host}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))


def worker_key(prefix: str, worker_id: str) -> str:
    return f"{prefix}:workers:{worker_id}"


def index_key(prefix: str) -> str:
    return f"{prefix}:workers"


class Registry:
    def __init__(self, settings: WorkerSettings, snapshot: Callable[[], dict[str, Any]]) -> None:
        if not settings.redis_url:
            raise ValueError("Registry needs redis_url")
        self.settings = settings
        self.snapshot = snapshot
        self.key = worker_key(settings.redis_prefix, settings.worker_id)
        self.index = index_key(settings.redis_prefix)
        self._where = redacted(settings.redis_url)
        self._redis = aioredis.from_url(settings.redis_url, socket_timeout=5, socket_connect_timeout=5)
        self._task: asyncio.Task[None] | None = None
        self._warned = False

    async def start(self) -> None:
        await self.publish()
        self._task = asyncio.create_task(self._beat(), name="adaserve-registry")

    async def publish(self) -> bool:
        """Write the entry now; False (logged once per outage) if Redis cannot be reached."""
        ttl_ms = int(self.settings.registration_ttl_s * 1000)
        now_ms = int(time.time() * 1000)
        body = json.dumps(self.snapshot())
        try:
            async with self._redis.pipeline(transaction=True) as pipe:
                pipe.set(self.key, body, px=ttl_ms)
                pipe.zadd(self.index, {self.settings.worker_id: now_ms + ttl_ms})
                pipe.zremrangebyscore(self.index, "-inf", now_ms)
                await pipe.execute()
        except (RedisError, OSError) as e:
            if not self._warned:
                log.warning("cannot register in Redis at %s: %s (will keep trying)", self._where, e)
            self._warned = True
            return False
        if self._warned:
            log.warning("registered in Redis again")
        self._warned = False
        return True

    async def _beat(self) -> None:
        while True:
            await asyncio.sleep(self.settings.heartbeat_s)
            try:
                await self.publish()
            except Exception:  # a bug in the snapshot must not end the heartbeat for good
                log.exception("registration heartbeat failed")

    async def stop(self) -> None:
        """Stop the heartbeat and remove the entry, so the gateway stops routing here at once."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        try:
            async with self._redis.pipeline(transaction=True) as pipe:
                pipe.delete(self.key)
                pipe.zrem(self.index, self.settings.worker_id)
                await pipe.execute()
        except (RedisError, OSError) as e:
            log.warning("cannot remove the registration from Redis: %s", e)
        await self._redis.aclose()
