"""Where the gateway keeps its record: request records, per-class counters, rate-limit buckets.

Two stores with one interface: ``RedisStore`` (shared by every gateway replica; the operator's
deployment) and ``MemoryStore`` (one process; ``adaserve up`` without Redis). Keys under the prefix:

    {prefix}:requests:{id}      HASH  id, slo_class, worker, status, tokens, ttft_ms, tpot_ms, slo_met, ...; TTL
    {prefix}:classes:{name}     HASH  counters: requests, finished, slo_met, shed, rate_limited, retries, tokens
    {prefix}:ratelimit:{key}    HASH  token bucket: tokens, ts (server time); expires when full again
"""

from __future__ import annotations

import time
from typing import Any, Protocol


class StateStore(Protocol):
    async def record(self, request_id: str, fields: dict[str, Any], *, ttl_s: int, slo_class: str | None = None,
                     counters: dict[str, int] | None = None) -> None:
        """Create or update a request's record (fields merge) and reset its TTL; with ``slo_class``, add
        ``counters`` to the class's counters in the same write (one round trip), as ``count`` would."""

    async def get_record(self, request_id: str) -> dict[str, str] | None: ...

    async def count(self, slo_class: str, counters: dict[str, int]) -> None:
        """Add to the class's counters."""

    async def counters(self, slo_class: str) -> dict[str, int]: ...

    async def take_token(self, bucket: str, *, rate_per_s: float, burst: float) -> float:
        """Take one token from the bucket: 0.0 if allowed, else seconds until one is available."""

    async def ping(self) -> bool: ...

    async def close(self) -> None: ...


def flatten(fields: dict[str, Any]) -> dict[str, str]:
    """Record values as strings (what a Redis hash holds): None -> "", bools -> "1"/"0"."""
    out = {}
    for k, v in fields.items():
        out[k] = "" if v is None else ("1" if v is True else "0" if v is False else str(v))
    return out


def refill(tokens: float, last_s: float, now_s: float, *, rate_per_s: float, burst: float) -> float:
    """Token bucket: ``tokens`` grows at ``rate_per_s`` since ``last_s``, capped at ``burst``."""
    return min(burst, tokens + max(0.0, now_s - last_s) * rate_per_s)


class MemoryStore:
    """One process's state; records expire lazily when read or when the table is swept."""

    def __init__(self) -> None:
        self._records: dict[str, tuple[float, dict[str, str]]] = {}
        self._counters: dict[str, dict[str, int]] = {}
        self._buckets: dict[str, tuple[float, float]] = {}

    async def record(self, request_id: str, fields: dict[str, Any], *, ttl_s: int, slo_class: str | None = None,
                     counters: dict[str, int] | None = None) -> None:
        now = time.monotonic()
        if len(self._records) > 10_000:
            self._records = {k: v for k, v in self._records.items() if v[0] > now}
        _, old = self._records.get(request_id, (0.0, {}))
        self._records[request_id] = (now + ttl_s, {**old, **flatten(fields)})
        if slo_class is not None and counters:
            self._add(slo_class, counters)

    async def get_record(self, request_id: str) -> dict[str, str] | None:
        entry = self._records.get(request_id)
        if entry is None or entry[0] <= time.monotonic():
            return None
        return dict(entry[1])

    def _add(self, slo_class: str, counters: dict[str, int]) -> None:
        c = self._counters.setdefault(slo_class, {})
        for k, n in counters.items():
            c[k] = c.get(k, 0) + n

    async def count(self, slo_class: str, counters: dict[str, int]) -> None:
        self._add(slo_class, counters)

    async def counters(self, slo_class: str) -> dict[str, int]:
        return dict(self._counters.get(slo_class, {}))

    async def take_token(self, bucket: str, *, rate_per_s: float, burst: float) -> float:
        now = time.monotonic()
        tokens, last = self._buckets.get(bucket, (burst, now))
        tokens = refill(tokens, last, now, rate_per_s=rate_per_s, burst=burst)
        if tokens >= 1.0:
            self._buckets[bucket] = (tokens - 1.0, now)
            return 0.0
        self._buckets[bucket] = (tokens, now)
        return (1.0 - tokens) / rate_per_s

    async def ping(self) -> bool:
        return True

    async def close(self) -> None:
        return None
