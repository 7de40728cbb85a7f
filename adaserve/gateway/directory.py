"""The workers the gateway can use: read from the workers' Redis registrations or polled from given URLs,
merged with what this gateway has in flight on each (a registration is up to one heartbeat old: load.py),
each with the correction this gateway has learnt for it (calibration.py).

Both sources yield the same document, the worker's registration (adaserve/contract/registration.py): Redis
holds the live ones (read with adaserve/contract/registry.py), and a worker serves its own at ``GET /v1/status``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import Protocol

import httpx
import redis.asyncio as aioredis
from redis.exceptions import RedisError

from adaserve.contract.registration import CostModel, Load, Registration, parse_registration
from adaserve.contract.registry import read_registrations
from adaserve.gateway.calibration import Calibration
from adaserve.gateway.load import OwnLoad, effective, mean_level
from adaserve.gateway.prediction import pooled_acceptance, predicted_tpot_ms
from adaserve.gateway.view import CurvePoint, WorkerView

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
    cost, load, measured = reg.cost_model, reg.load, reg.measured
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
        lone_tpot_ms=reg.lone_tpot_ms,
        curve=tuple(CurvePoint(p.requests, p.steps, p.iteration_ms, p.tokens_per_request,
                               {c: (t.tokens, t.decodes) for c, t in p.tokens_by_class.items()},
                               {c: t.iteration_ms for c, t in p.tokens_by_class.items() if t.iteration_ms is not None})
                    for p in sorted(measured.iterations, key=lambda p: p.requests)),
        class_accepted={c: r.accepted_per_verification for c, r in measured.classes.items()
                        if r.accepted_per_verification is not None},
        class_ttft_ms={c: r.min_ttft_ms for c, r in measured.classes.items() if r.min_ttft_ms is not None},
    )


@dataclass(frozen=True)
class Lesson:
    """What one finished request taught: the TPOT predicted at the mean load it decoded under (before the
    correction), that load, and the worker's correction before and after it."""

    predicted_ms: float | None
    load: float | None
    before: float
    after: float


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
    def __init__(self, source: Source, *, refresh_s: float, suspect_s: float,
                 calibration: Calibration | None = None) -> None:
        self.source = source
        self.refresh_s, self.suspect_s = refresh_s, suspect_s
        self.calibration = calibration or Calibration()
        self._views: list[WorkerView] = []
        self._written: dict[str, float | None] = {}  # each registration's updated_at (worker's clock, unix s)
        self._own: dict[str, OwnLoad] = {}
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
        self._written = {reg.worker_id: reg.updated_at for reg in regs}
        for wid in self._own:
            self._tick(wid)
        self._notify()

    # ---- what routing sees -------------------------------------------------------------------------
    def all(self) -> list[WorkerView]:
        return list(self._views)

    def _merged(self, v: WorkerView) -> WorkerView:
        """``v`` with the load it holds now (load.effective) and this gateway's correction for it."""
        own = self._own.get(v.id)
        k = self.calibration.correction(v.id)
        if own is None:
            return v if k == 1.0 else dataclasses.replace(v, correction=k)
        written = self._written.get(v.id)
        by_class = effective(v.active_by_class, own.now, own.at(written) if written is not None else None)
        active = sum(by_class.values())
        if written is None:
            active = max(v.active, sum(own.now.values()))
        return dataclasses.replace(v, active=active, active_by_class={c: n for c, n in by_class.items() if n},
                                   correction=k)

    def usable(self, model: str | None = None) -> list[WorkerView]:
        """Ready, not suspected, serving ``model``; loads as they are now, corrections applied."""
        now = time.monotonic()
        out = []
        for v in self._views:
            if v.status != "ready" or self._suspect.get(v.id, 0.0) > now:
                continue
            if model is not None and v.model is not None and v.model != model:
                continue
            out.append(self._merged(v))
        return out

    def models(self) -> list[str]:
        return sorted({v.model for v in self._views if v.model})

    # ---- this gateway's own bookkeeping ---------------------------------------------------------------
    def _tick(self, worker_id: str) -> tuple[float, float]:
        own = self._own.setdefault(worker_id, OwnLoad())
        view = next((v for v in self._views if v.id == worker_id), None)
        level = self._merged(view).active if view is not None else sum(own.now.values())
        return own.tick(level)

    def acquire(self, worker_id: str, slo_class: str) -> None:
        self._own.setdefault(worker_id, OwnLoad()).change(slo_class, +1)
        self._tick(worker_id)

    def release(self, worker_id: str, slo_class: str) -> None:
        own = self._own.get(worker_id)
        if own is not None and own.now[slo_class] > 0:
            own.change(slo_class, -1)
            self._tick(worker_id)
        self._notify()

    def mark(self, worker_id: str) -> tuple[float, float]:
        """The worker's load integral now: two marks give the mean load between them (load.mean_level)."""
        return self._tick(worker_id)

    def learn(self, worker_id: str, slo_class: str, since: tuple[float, float], *, observed_ms: float | None,
              tokens: int) -> Lesson:
        """A request that decoded on the worker from mark ``since`` until now got ``observed_ms`` per token:
        compare with the TPOT predicted at the mean load it saw, and learn."""
        n = mean_level(since, self.mark(worker_id))
        before = self.calibration.correction(worker_id)
        view = next((v for v in self._views if v.id == worker_id), None)
        if view is None or n is None:
            return Lesson(None, n, before, before)
        predicted = predicted_tpot_ms(view, slo_class, max(1.0, n), acceptance=pooled_acceptance(self._views))
        k = self.calibration.observe(worker_id, predicted_ms=predicted, observed_ms=observed_ms, tokens=tokens)
        return Lesson(predicted, n, before, k)

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
