"""The workers the gateway can use: read from the workers' Redis registrations or polled from given URLs,
merged with what this gateway has in flight on each (a registration is up to one heartbeat old).

Both sources yield the same document, the worker's registration (adaserve/contract/registration.py): Redis
holds the live ones (read with adaserve/contract/registry.py), and a worker serves its own at ``GET /v1/status``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections import Counter
from typing import Protocol

import httpx
import redis.asyncio as aioredis
from redis.exceptions import RedisError

from adaserve.contract.registration import CostModel, Load, Registration, parse_registration
from adaserve.contract.registry import read_registrations
from adaserve.gateway.routing import WorkerView

log = logging.getLogger(__name__)


def _cost(model: CostModel | None) -> dict[str, float] | None:
    return None if model is None else model.model_dump()


def _per_request(load: Load) -> float | None:
    """Mean KV tokens per request the worker holds; None when it holds none (routing assumes a typical one)."""
    held = load.running + load.waiting
    tokens = load.context_tokens
    return tokens / held if tokens is not None and held > 0 and tokens > 0 else None


def worker_view(reg: Registration) -> WorkerView:
    """A registration as routing sees it (before this gateway's own requests are added)."""
    cost, load = reg.cost_model, reg.load
    return WorkerView(
        id=reg.worker_id, address=reg.address.rstrip("/"), status=reg.status, model=reg.models.name,
        max_active=reg.capacity.max_active_requests or 1,
        active=load.active, active_by_class=dict(load.active_by_class),
        budget=reg.budget,
        target_cost=_cost(cost.target) if cost else None, draft_cost=_cost(cost.draft) if cost else None,
        # before its first verification a worker's rate says nothing: routing assumes a prior instead
        acceptance_rate=reg.acceptance.acceptance_rate if reg.acceptance.steps else None,
        context_per_request=_per_request(load),
        draft_steps=reg.max_depth,
        unloaded_tpot_ms=reg.unloaded_tpot_ms,
    )


class Source(Protocol):
    async def read(self) -> list[Registration]: ...

    async def close(self) -> None: ...


class RedisSource:
    def __init__(self, redis: aioredis.Redis, prefix: str) -> None:
        self.redis, self.prefix = redis, prefix

    async def read(self) -> list[Registration]:
        return await read_registrations(self.redis, self.prefix)

    async def close(self) -> None:
        return None


class StaticSource:
    """Fixed worker URLs (``adaserve up``, or a gateway without Redis): poll each one's ``/v1/status``."""

    def __init__(self, urls: list[str], client: httpx.AsyncClient) -> None:
        self.urls, self.client = urls, client

    async def _one(self, url: str) -> Registration | None:
        try:
            r = await self.client.get(f"{url}/v1/status", timeout=2.0)
            if r.status_code != 200:
                return None
            reg = parse_registration(r.json())
        except (httpx.HTTPError, ValueError):
            return None
        # the URL we were given is how we reach it, whatever it advertises
        return None if reg is None else reg.model_copy(update={"address": url})

    async def read(self) -> list[Registration]:
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
            regs = await self.source.read()
        except (RedisError, OSError) as e:
            if self.last_error is None:
                log.warning("cannot read the worker registrations: %s", e)
            self.last_error = str(e)
            return
        self.last_error = None
        self._views = [worker_view(reg) for reg in regs]
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
