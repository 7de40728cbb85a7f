"""Admit, queue or shed: the decision made before a request goes to a worker.

1. Some worker has headroom for the request's class: send it to the one the router picks.
2. None has (every batch would miss a target if it joined), but some have free slots: a sheddable class
   (priority < 0) is refused at once, 503 + Retry-After, so the others keep their pace; any other class
   waits up to ``queue_timeout_s`` for headroom and then goes, best effort, to the router's pick, or,
   with ``on_overload="refuse"``, is refused: serving it late would slow the batch it joins too.
3. No worker has a free slot (or none is ready): wait up to ``queue_timeout_s``, then 503.
At most ``max_queued`` requests wait at once; beyond that 503 at once.

Waiting requests go in ``rank`` order: higher class priority first, then the tighter TPOT target, then
earlier arrival. A request that has headroom stands aside (waits) while a waiter ranked ahead of it, for
the same model, has headroom for its own class too; a waiter ahead that has none holds nobody back, so
there is no head-of-line blocking. Standing aside is waiting: it takes a queue place, and at the deadline
rules 2 and 3 decide as for any wait. A waiter that leaves the queue, however it leaves, wakes the others,
so the caller must count an admitted request on its worker (``Directory.acquire``) before its next
``await``: a waiter woken meanwhile would see the old load.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from dataclasses import dataclass, field

from adaserve.gateway.directory import Directory
from adaserve.gateway.errors import ApiError
from adaserve.gateway.metrics import GatewayMetrics
from adaserve.gateway.routing import Choice, Router, WorkerView, best_headroom
from adaserve.gateway.settings import GatewaySettings
from adaserve.gateway.slo import SloCatalog, SloClass, feasibility


class Refused(ApiError):
    """503 before any worker saw the request; ``reason`` labels the metric."""

    def __init__(self, message: str, *, reason: str, retry_after: int) -> None:
        super().__init__(503, message, code=reason, retry_after=retry_after)
        self.reason = reason


def rank(slo: SloClass, arrival: int) -> tuple[int, float, int]:
    """Queue order, lowest first: higher priority, then the tighter TPOT target, then earlier arrival."""
    return (-slo.priority, slo.tpot_ms, arrival)


@dataclass(eq=False)
class Waiter:
    """One request being admitted; ``arrival`` is its turn number at this gateway."""

    slo: SloClass
    model: str | None
    exclude: set[str]
    arrival: int
    rank: tuple[int, float, int] = field(init=False)

    def __post_init__(self) -> None:
        self.rank = rank(self.slo, self.arrival)


class Admission:
    def __init__(self, directory: Directory, router: Router, catalog: SloCatalog, settings: GatewaySettings,
                 metrics: GatewayMetrics) -> None:
        self.directory, self.router, self.catalog = directory, router, catalog
        self.settings, self.metrics = settings, metrics
        self.queue: list[Waiter] = []  # waiting now, in arrival order
        self._arrivals = itertools.count()
        self._left = asyncio.Event()  # set (and replaced) whenever a waiter leaves the queue

    @property
    def waiting(self) -> int:
        return len(self.queue)

    def _refuse(self, message: str, reason: str) -> Refused:
        return Refused(message, reason=reason, retry_after=self.settings.retry_after_s)

    @staticmethod
    def _for(w: Waiter, usable: list[WorkerView]) -> list[WorkerView]:
        """The workers ``w`` may go to, of those usable for its model."""
        return [v for v in usable if v.id not in w.exclude] if w.exclude else usable

    def _ahead_can_go(self, me: Waiter, usable: list[WorkerView]) -> bool:
        """Some waiter ranked ahead of ``me``, for the same model (so ``usable`` is its list too), has
        headroom for its own class now."""
        for w in self.queue:
            if w is me or w.model != me.model or w.rank >= me.rank:
                continue
            best = best_headroom(self._for(w, usable), w.slo.tpot_ms, self.catalog.tpot_of)
            if best is not None and best >= 0:
                return True
        return False

    def _idle_choice(self, slo: SloClass, workers: list[WorkerView], routed: Choice | None) -> Choice | None:
        """An idle worker on which a lone request of this class meets its target (its own measured unloaded
        latency says so): admitted at once, whatever the headroom model predicts, since waiting cannot make
        an idle worker faster; it only adds to the request's TTFT. The routing policy's own pick goes first
        (round-robin stays round-robin); another idle worker only when that one is not."""
        first = [routed.worker] if routed is not None else []
        for w in [*first, *(v for v in workers if not first or v.id != first[0].id)]:
            fits = feasibility(slo.tpot_ms, unloaded_tpot_ms=w.unloaded_tpot_ms, max_depth=w.draft_steps)
            if w.active == 0 and w.free_slots > 0 and fits in ("plain", "speculation"):
                room = best_headroom([w], slo.tpot_ms, self.catalog.tpot_of)
                return Choice(w, room if room is not None else 0.0, room if room is not None else 0.0)
        return None

    async def admit(self, slo: SloClass, *, model: str | None, exclude: set[str]) -> Choice:
        me = Waiter(slo, model, exclude, next(self._arrivals))
        deadline = time.monotonic() + self.settings.queue_timeout_s
        try:
            while True:
                usable = self.directory.usable(model)  # once per pass: every waiter ahead has this model
                workers = self._for(me, usable)
                choice = self.router.choose(workers, slo.tpot_ms, self.catalog.tpot_of)
                idle = self._idle_choice(slo, workers, choice)
                if idle is not None and not self._ahead_can_go(me, usable):
                    return idle
                if choice is not None and choice.best_headroom >= 0:
                    if not self._ahead_can_go(me, usable):
                        return choice
                elif choice is not None and slo.sheddable:
                    raise self._refuse(f"overloaded: no worker can meet SLO class {slo.name!r} now, and the "
                                       "class is sheddable; retry later", "shed")
                if time.monotonic() >= deadline:
                    if choice is not None and choice.best_headroom < 0 and self.settings.on_overload == "refuse":
                        raise self._refuse(f"overloaded: no worker could meet SLO class {slo.name!r} within "
                                           f"{self.settings.queue_timeout_s:g}s; retry later", "overloaded")
                    if choice is not None:
                        return choice  # best effort: the class is not sheddable (or it stood aside until now)
                    if not workers:
                        raise self._refuse("no worker is ready to serve this model", "no_workers")
                    raise self._refuse("overloaded: every worker is at its request limit", "overloaded")
                if me not in self.queue:
                    if len(self.queue) >= self.settings.max_queued:
                        raise self._refuse("overloaded: the admission queue is full", "queue_full")
                    self.queue.append(me)
                    self.metrics.queued.set(len(self.queue))
                await self._sleep(min(deadline - time.monotonic(), self.settings.refresh_s))
        finally:  # admitted, refused, timed out or cancelled (client gone): leave, and let the others look again
            if me in self.queue:
                self.queue.remove(me)
                self.metrics.queued.set(len(self.queue))
                self._left.set()
                self._left = asyncio.Event()

    async def _sleep(self, timeout_s: float) -> None:
        """Until a request ends here, the worker list is re-read or a waiter leaves the queue; at most timeout_s."""
        waits = (asyncio.ensure_future(self._left.wait()),
                 asyncio.ensure_future(self.directory.wait_change(timeout_s)))
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in waits:
                task.cancel()
