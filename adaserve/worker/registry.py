"""The worker's registration in Redis: its registration document with a TTL, refreshed by a heartbeat.

Key schema and the readers' side: adaserve/contract/registry.py. Each heartbeat writes the entry and its
index member in one transaction and prunes index members whose entries have expired, so a worker that
crashed drops out when its TTL passes.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Callable

from redis.exceptions import RedisError

from adaserve.contract.redis_settings import redacted
from adaserve.contract.registration import Registration
from adaserve.contract.registry import index_key, worker_key
from adaserve.redis_client import connect
from adaserve.worker.settings import WorkerSettings

log = logging.getLogger(__name__)


class Registry:
    def __init__(self, settings: WorkerSettings, snapshot: Callable[[], Registration]) -> None:
        if not settings.redis_url:
            raise ValueError("Registry needs redis_url")
        self.settings = settings
        self.snapshot = snapshot
        self.key = worker_key(settings.redis_prefix, settings.worker_id)
        self.index = index_key(settings.redis_prefix)
        self._where = redacted(settings.redis_url)
        self._redis = connect(settings.redis_url, settings.redis_auth, timeout_s=5)
        self._task: asyncio.Task[None] | None = None
        self._warned = False

    async def start(self) -> None:
        await self.publish()
        self._task = asyncio.create_task(self._beat(), name="adaserve-registry")

    async def publish(self) -> bool:
        """Write the entry now; False (logged once per outage) if Redis cannot be reached."""
        ttl_ms = int(self.settings.registration_ttl_s * 1000)
        now_ms = int(time.time() * 1000)
        body = json.dumps(self.snapshot().document())
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
