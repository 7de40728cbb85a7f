"""Admit, queue or shed: the decision made before a request goes to a worker.

1. Some worker has headroom for the request's class: send it to the one the router picks.
2. None has (every batch would miss a target if it joined), but some have free slots: a sheddable class
   (priority < 0) is refused at once, 503 + Retry-After, so the others keep their pace; any other class
   waits up to ``queue_timeout_s`` for headroom and then goes, best effort, to the router's pick.
3. No worker has a free slot (or none is ready): wait up to ``queue_timeout_s``, then 503.
At most ``max_queued`` requests wait at once; beyond that 503 at once.
"""

from __future__ import annotations

import time

from adaserve.gateway.directory import Directory
from adaserve.gateway.errors import ApiError
from adaserve.gateway.metrics import GatewayMetrics
from adaserve.gateway.routing import Choice, Router
from adaserve.gateway.settings import GatewaySettings
from adaserve.gateway.slo import SloCatalog, SloClass


class Refused(ApiError):
    """503 before any worker saw the request; ``reason`` labels the metric."""

    def __init__(self, message: str, *, reason: str, retry_after: int) -> None:
        super().__init__(503, message, code=reason, retry_after=retry_after)
        self.reason = reason


class Admission:
    def __init__(self, directory: Directory, router: Router, catalog: SloCatalog, settings: GatewaySettings,
                 metrics: GatewayMetrics) -> None:
        self.directory, self.router, self.catalog = directory, router, catalog
        self.settings, self.metrics = settings, metrics
        self.waiting = 0

    def _refuse(self, message: str, reason: str) -> Refused:
        return Refused(message, reason=reason, retry_after=self.settings.retry_after_s)

    async def admit(self, slo: SloClass, *, model: str | None, exclude: set[str]) -> Choice:
        deadline = time.monotonic() + self.settings.queue_timeout_s
        queued = False
        try:
            while True:
                workers = [w for w in self.directory.usable(model) if w.id not in exclude]
                self.metrics.workers.set(len(workers))
                choice = self.router.choose(workers, slo.tpot_ms, self.catalog.tpot_of)
                if choice is not None and choice.best_headroom >= 0:
                    return choice
                if choice is not None and slo.sheddable:
                    raise self._refuse(f"overloaded: no worker can meet SLO class {slo.name!r} now, and the "
                                       "class is sheddable; retry later", "shed")
                if time.monotonic() >= deadline:
                    if choice is not None:
                        return choice  # best effort: the class is not sheddable
                    if not workers:
                        raise self._refuse("no worker is ready to serve this model", "no_workers")
                    raise self._refuse("overloaded: every worker is at its request limit", "overloaded")
                if not queued:
                    if self.waiting >= self.settings.max_queued:
                        raise self._refuse("overloaded: the admission queue is full", "queue_full")
                    queued = True
                    self.waiting += 1
                    self.metrics.queued.set(self.waiting)
                await self.directory.wait_change(min(deadline - time.monotonic(), self.settings.refresh_s))
        finally:
            if queued:
                self.waiting -= 1
                self.metrics.queued.set(self.waiting)
