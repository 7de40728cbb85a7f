"""The state store in Redis: what every gateway replica shares (key schema in state.py)."""

from __future__ import annotations

from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.client import Pipeline
from redis.exceptions import RedisError

from adaserve import redis_client
from adaserve.gateway.state import flatten
from adaserve.redis_client import RedisAuth

# Token bucket in one atomic step, timed by the Redis server's clock so replicas agree.
# KEYS[1] bucket; ARGV rate_per_s, burst. Returns {allowed (1/0), wait_ms}.
TAKE_TOKEN = """
local rate = tonumber(ARGV[1])
local burst = tonumber(ARGV[2])
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
local b = redis.call('HMGET', KEYS[1], 'tokens', 'ts')
local tokens = tonumber(b[1]) or burst
local ts = tonumber(b[2]) or now
tokens = math.min(burst, tokens + math.max(0, now - ts) * rate)
local allowed = 0
local wait_ms = 0
if tokens >= 1 then
  tokens = tokens - 1
  allowed = 1
else
  wait_ms = math.ceil((1 - tokens) / rate * 1000)
end
redis.call('HSET', KEYS[1], 'tokens', tostring(tokens), 'ts', tostring(now))
redis.call('PEXPIRE', KEYS[1], math.ceil((burst - tokens) / rate * 1000) + 1000)
return {allowed, wait_ms}
"""


def connect(url: str, auth: RedisAuth | None = None) -> aioredis.Redis:
    """The gateway's client: short timeouts (a slow Redis must not hold requests), text replies."""
    return redis_client.connect(url, auth, timeout_s=2, decode_responses=True)


class RedisStore:
    def __init__(self, client: aioredis.Redis, prefix: str) -> None:
        self.redis, self.prefix = client, prefix
        self._take = self.redis.register_script(TAKE_TOKEN)

    def key(self, *parts: str) -> str:
        return ":".join((self.prefix, *parts))

    async def record(self, request_id: str, fields: dict[str, Any], *, ttl_s: int, slo_class: str | None = None,
                     counters: dict[str, int] | None = None) -> None:
        key = self.key("requests", request_id)
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.hset(key, mapping=flatten(fields))
            pipe.expire(key, ttl_s)
            if slo_class is not None and counters:
                self._add_counters(pipe, slo_class, counters)
            await pipe.execute()

    async def get_record(self, request_id: str) -> dict[str, str] | None:
        got = await self.redis.hgetall(self.key("requests", request_id))
        return dict(got) if got else None

    def _add_counters(self, pipe: Pipeline, slo_class: str, counters: dict[str, int]) -> None:
        key = self.key("classes", slo_class)
        for name, n in counters.items():
            pipe.hincrby(key, name, n)

    async def count(self, slo_class: str, counters: dict[str, int]) -> None:
        async with self.redis.pipeline(transaction=False) as pipe:
            self._add_counters(pipe, slo_class, counters)
            await pipe.execute()

    async def counters(self, slo_class: str) -> dict[str, int]:
        got = await self.redis.hgetall(self.key("classes", slo_class))
        return {k: int(v) for k, v in got.items()}

    async def take_token(self, bucket: str, *, rate_per_s: float, burst: float) -> float:
        allowed, wait_ms = await self._take(keys=[self.key("ratelimit", bucket)], args=[rate_per_s, burst])
        return 0.0 if int(allowed) else int(wait_ms) / 1000.0

    async def ping(self) -> bool:
        try:
            return bool(await self.redis.ping())
        except (RedisError, OSError):
            return False

    async def close(self) -> None:
        await self.redis.aclose()
