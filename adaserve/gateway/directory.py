"""The workers the gateway can use: read from the workers' Redis registrations or polled from given URLs,
merged with what this gateway has in flight on each (a registration is up to one heartbeat old).

Both sources yield the same document, the worker's registration (docs/worker.md): Redis holds it under
``{prefix}:workers:{id}`` (listed by ``ZRANGEBYSCORE {prefix}:workers (now_ms +inf``), and a worker
serves it at ``GET /v1/status``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import time
from collections import Counter
from typing import Any, Protocol

import httpx
import redis.asyncio as aioredis
from redis.exceptions import RedisError

from adaserve.gateway.routing import WorkerView
from adaserve.worker.registry import index_key, worker_key

log = logging.getLogger(__name__)


COST_KEYS = ("alpha", "gamma", "delta")


def _cost_model(raw: Any) -> dict[str, float] | None:
    """A cost model ``{alpha, gamma, delta}`` with numbers; anything else counts as none (routing by slots)."""
    if raw is None:
        return None
    return {k: float(raw[k]) for k in COST_KEYS}  # KeyError/TypeError/ValueError: not a registration


def _per_request(load: dict[str, Any]) -> float | None:
    """Mean KV tokens per request the worker holds; None when it holds none (routing assumes a typical one)."""
    held = int(load.get("running", 0)) + int(load.get("waiting", 0))
    tokens = load.get("context_tokens")
    return float(tokens) / held if tokens is not None and held > 0 and float(tokens) > 0 else None


def parse_registration(doc: Any) -> WorkerView | None:
    """A registration as a routing view; None when it is not one (an older or foreign schema)."""
    try:
        load = doc.get("load") or {}
        cost = doc.get("cost_model") or {}
        acc = doc.get("acceptance") or {}
        return WorkerView(
            id=str(doc["worker_id"]), address=str(doc["address"]).rstrip("/"), status=str(doc["status"]),
            model=(doc.get("models") or {}).get("name"),
            max_active=int((doc.get("capacity") or {}).get("max_active_requests") or 1),
            active=int(load.get("active", 0)),
            active_by_class={str(k): int(v) for k, v in (load.get("active_by_class") or {}).items()},
            budget=int(doc["budget"]) if doc.get("budget") is not None else None,
            target_cost=_cost_model(cost.get("target")), draft_cost=_cost_model(cost.get("draft")),
            acceptance_rate=float(acc["acceptance_rate"]) if acc.get("steps") else None,
            context_per_request=_per_request(load),
            draft_steps=int(doc["max_depth"]) if doc.get("max_depth") is not None else None,
        )
    except (AttributeError, KeyError, TypeError, ValueError):
        return None


class Source(Protocol):
    async def read(self) -> list[dict[str, Any]]: ...

    async def close(self) -> None: ...


class RedisSource:
    def __init__(self, redis: aioredis.Redis, prefix: str) -> None:
        self.redis, self.prefix = redis, prefix

    async def read(self) -> list[dict[str, Any]]:
        ids = await self.redis.zrangebyscore(index_key(self.prefix), f"({int(time.time() * 1000)}", "+inf")
        if not ids:
            return []
        raw = await self.redis.mget([worker_key(self.prefix, i) for i in ids])  # a decode_responses client
        docs = []
        for body in raw:
            if body is None:  # expired between the two reads
                continue
            with contextlib.suppress(json.JSONDecodeError):
                docs.append(json.loads(body))
        return docs

    async def close(self) -> None:
        return None


class StaticSource:
    """Fixed worker URLs (``adaserve up``, or a gateway without Redis): poll each one's ``/v1/status``."""

    def __init__(self, urls: list[str], client: httpx.AsyncClient) -> None:
        self.urls, self.client = urls, client

    async def _one(self, url: str) -> dict[str, Any] | None:
        try:
            r = await self.client.get(f"{url}/v1/status", timeout=2.0)
            if r.status_code != 200:
                return None
            doc = r.json()
            doc["address"] = url  # the URL we were given is how we reach it, whatever it advertises
            return doc
        except (httpx.HTTPError, ValueError):
            return None

    async def read(self) -> list[dict[str, Any]]:
        got = await asyncio.gather(*(self._one(u) for u in self.urls))
        return [d for d in got if d is not None]

    async def close(self) -> None:
        return None


class Directory:
    def __init__(self, source: Source, *, refresh_s: float, suspect_s: float) -> None:
        self.source = source
        self.refresh_s, self.suspect_s = refresh_s, suspect_s
        self._views: list[WorkerView] = []
        self._own: dict[str, Counter[str]] = {}
        self._suspect: dict[str, float] = {}
        self._changed = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.last_error: str | None = None

    async def start(self) -> None:
        await self.refresh()
        self._task = asyncio.create_task(self._loop(), name="adaserve-gateway-directory")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self.source.close()

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.refresh_s)
            try:
                await self.refresh()
            except Exception:  # keep routing on the last good list rather than die
                log.exception("reading the worker list failed")

    async def refresh(self) -> None:
        try:
            docs = await self.source.read()
        except (RedisError, OSError) as e:
            if self.last_error is None:
                log.warning("cannot read the worker registrations: %s", e)
            self.last_error = str(e)
            return
        self.last_error = None
        views = [v for v in map(parse_registration, docs) if v is not None]
        self._views = views
        self._notify()

    # ---- what routing sees -------------------------------------------------------------------------
    def all(self) -> list[WorkerView]:
        return list(self._views)

    def usable(self, model: str | None = None) -> list[WorkerView]:
        """Ready, not suspected, serving ``model``; loads raised to this gateway's own in-flight counts."""
        now = time.monotonic()
        out = []
        for v in self._views:
            if v.status != "ready" or self._suspect.get(v.id, 0.0) > now:
                continue
            if model is not None and v.model is not None and v.model != model:
                continue
            own = self._own.get(v.id, Counter())
            by_class = {c: max(v.active_by_class.get(c, 0), own[c]) for c in {*v.active_by_class, *own}}
            out.append(dataclasses.replace(v, active=max(v.active, sum(own.values())), active_by_class=by_class))
        return out

    def models(self) -> list[str]:
        return sorted({v.model for v in self._views if v.model})

    # ---- this gateway's own bookkeeping ---------------------------------------------------------------
    def acquire(self, worker_id: str, slo_class: str) -> None:
        self._own.setdefault(worker_id, Counter())[slo_class] += 1

    def release(self, worker_id: str, slo_class: str) -> None:
        own = self._own.get(worker_id)
        if own is not None and own[slo_class] > 0:
            own[slo_class] -= 1
        self._notify()

    def mark_failed(self, worker_id: str) -> None:
        """Skip a worker that just failed a request until its next chance (``suspect_s``)."""
        self._suspect[worker_id] = time.monotonic() + self.suspect_s

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def wait_change(self, timeout_s: float) -> None:
        """Until a request ends here or the worker list is re-read, at most ``timeout_s``."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._changed.wait(), timeout_s)
