"""Admit, queue or refuse: the decision made before a request goes to a worker (``admission="slo"``, the default).

1. Some worker has slack for the request (routing.py: every target on it, this request's included, should still
   hold if it joined, with ``slo_margin`` to spare): send it to the one the router picks, at once. An idle
   worker that can meet the class alone always has slack, so an idle fleet never queues a request of a
   feasible class.
2. None has, but some have free slots: a sheddable class (priority < 0) is refused at once, 503 + Retry-After,
   so the others keep their pace; any other class waits for slack, up to its wait budget. Sheddable requests
   use only the headroom the others leave, by reservation: while a non-sheddable request for the same model
   waits for slack, and for ``shed_window_s`` after one had to wait or was refused for want of it, its class is
   *reserved*, and a sheddable request goes only to a worker where, after it joined, one request of each
   reserved class would still keep every target (``routing.room_for``); elsewhere it is refused at once even
   where it would fit. So a summary never takes the place a chat needs, nor pushes a worker further from the
   load a waiting coding request fits in, while it may still fill what the reserved classes cannot use. Two
   rules came before this one, each measured wrong (docs/benchmarks.md, loadtest runs 4 and 6): refusing every
   sheddable request while any other waited lost 7 of 11 summaries at 2x for nothing (goodput 70% of the
   peak); yielding only to a waiter one freed place would let in inverted priorities (at 2x no chat or coding
   request got in while 7 of 8 summaries did: a chat needing two places never got them).
3. No worker has a free slot (or none is ready): wait, up to the wait budget.
4. The wait budget is ``queue_timeout_s``, shortened for a class with a TTFT target to what that target leaves
   after the time from admission to a first token that this gateway's recent requests of the class took (their
   75th percentile; before any, the least TTFT a worker has recently given the class): a request whose wait
   would already break its target is refused then, not served late. At the end of its wait a request still
   without slack is refused, 503 + Retry-After (or, with ``on_overload="best-effort"``, served late by the
   router's pick, slowing the batch it joins).
5. A class that no worker can meet even for a lone request (routing.feasible_anywhere) is served best effort:
   held to what a worker gives a lone request of it (plus routing.BEST_EFFORT_ROOM) instead of its target, so
   it waits for a worker that can serve it about as well as alone; the others' targets still count (or,
   ``on_infeasible="refuse"``, 503).
6. A request whose workers went away while it waited (it saw a usable worker, or a worker already failed it:
   a drain, a crash, a restart) and that finds none usable now waits for one, up to ``worker_wait_s`` from its
   arrival, whatever its budget: refusing it would only move the wait to the client. A request that never
   saw a worker is refused ``no_workers`` at the end of its budget.
At most ``max_queued`` requests wait at once; beyond that 503 at once.

Prefix affinity (prefix_index.py): a request's block keys come with it, and at each look the router is told how
many of them each worker holds; it decides only which worker with headroom takes the request, never whether
one does.

``admission="none"`` is a plain load balancer, for comparison: the router's pick among workers with a free
slot, at once; without one, wait up to ``queue_timeout_s``, then 503.

Waiting requests go in ``rank`` order: higher class priority first, then the tighter TPOT target, then earlier
arrival. A request that could go stands aside (waits) while a waiter ranked ahead of it, for the same model,
could go too; a waiter ahead that cannot holds nobody back, so there is no head-of-line blocking. A waiter that
leaves the queue, however it leaves, wakes the others, so the caller must count an admitted request on its
worker (``Directory.acquire``) before its next ``await``: a waiter woken meanwhile would see the old load.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from adaserve.gateway.directory import Directory
from adaserve.gateway.errors import ApiError
from adaserve.gateway.metrics import GatewayMetrics
from adaserve.gateway.prediction import lone_tpot_ms
from adaserve.gateway.prefix_index import PrefixIndex
from adaserve.gateway.routing import Choice, Router, best_slack, feasible_anywhere, room_for
from adaserve.gateway.settings import GatewaySettings
from adaserve.gateway.slo import SloCatalog, SloClass
from adaserve.gateway.view import WorkerView


class Refused(ApiError):
    """503 before any worker saw the request; ``reason`` labels the metric."""

    def __init__(self, message: str, *, reason: str, retry_after: int) -> None:
        super().__init__(503, message, code=reason, retry_after=retry_after)
        self.reason = reason


def rank(slo: SloClass, arrival: int) -> tuple[int, float, int]:
    """Queue order, lowest first: higher priority, then the tighter TPOT target, then earlier arrival."""
    return (-slo.priority, slo.tpot_ms, arrival)


def worker_ttft_ms(workers: list[WorkerView], slo_class: str) -> float | None:
    """The least TTFT any worker has recently given the class (from its own arrival): what it adds at best."""
    seen = [w.class_ttft_ms[slo_class] for w in workers if slo_class in w.class_ttft_ms]
    return min(seen) if seen else None


def wait_budget_s(slo: SloClass, queue_timeout_s: float, worker_ttft_ms: float | None) -> float:
    """How long a request of the class may wait for slack: ``queue_timeout_s``, or less when the class has a TTFT
    target: that target minus the least TTFT a worker adds (0 when it has not said). Waiting longer would make
    the target unreachable whatever happens next."""
    if slo.ttft_ms is None:
        return queue_timeout_s
    return max(0.0, min(queue_timeout_s, (slo.ttft_ms - (worker_ttft_ms or 0.0)) / 1e3))


def reserved_classes(pressed: dict[tuple[str | None, str], float], queue: list[Waiter], model: str | None,
                     now: float, window_s: float) -> set[str]:
    """The classes sheddable requests for ``model`` must leave room for (rule 2): those of the non-sheddable
    requests waiting for slack now, and those ``pressed`` (model, class -> monotonic seconds when one last had to
    wait or was refused for want of slack) less than ``window_s`` ago."""
    waiting = {w.slo.name for w in queue if w.model == model and w.short}
    return waiting | {c for (m, c), at in pressed.items() if m == model and now - at < window_s}


@dataclass(eq=False)
class Waiter:
    """One request being admitted; ``arrival`` is its turn number at this gateway."""

    slo: SloClass
    model: str | None
    exclude: set[str]
    arrival: int
    keys: Sequence[int] = ()  # its prefix's block keys (prefix_index.py), for prefix affinity
    best_effort: bool = False  # its class is infeasible everywhere (as of its last look)
    short: bool = False  # non-sheddable, of a class some worker can meet, and no worker had slack (last look)
    saw_workers: bool = False  # some worker was usable for it at one of its looks (rule 6)
    rank: tuple[int, float, int] = field(init=False)

    def __post_init__(self) -> None:
        self.rank = rank(self.slo, self.arrival)


@dataclass(frozen=True)
class Admitted:
    """Where a request goes, and how it got there."""

    choice: Choice
    waited_s: float
    queued: bool  # it waited in the queue (False: admitted on its first look)
    mode: str  # slo (every target should hold) | best_effort (infeasible class) | late (on_overload) | plain


class Admission:
    def __init__(self, directory: Directory, router: Router, catalog: SloCatalog, settings: GatewaySettings,
                 metrics: GatewayMetrics, prefixes: PrefixIndex | None = None) -> None:
        self.directory, self.router, self.catalog = directory, router, catalog
        self.settings, self.metrics = settings, metrics
        self.prefixes = prefixes  # None: no prefix affinity
        self.queue: list[Waiter] = []  # waiting now, in arrival order
        self._arrivals = itertools.count()
        self._left = asyncio.Event()  # set (and replaced) whenever a waiter leaves the queue
        self._pressed: dict[tuple[str | None, str], float] = {}  # (model, class) -> last wait or refusal (rule 2)

    @property
    def waiting(self) -> int:
        return len(self.queue)

    def target(self, slo_class: str) -> float | None:
        """What admission holds a class's TPOT to: its target less ``slo_margin``."""
        tpot = self.catalog.tpot_of(slo_class)
        return None if tpot is None else tpot * (1.0 - self.settings.slo_margin)

    def _refuse(self, message: str, reason: str) -> Refused:
        return Refused(message, reason=reason, retry_after=self.settings.retry_after_s)

    @staticmethod
    def _for(w: Waiter, usable: list[WorkerView]) -> list[WorkerView]:
        """The workers ``w`` may go to, of those usable for its model."""
        return [v for v in usable if v.id not in w.exclude] if w.exclude else usable

    def _can_go(self, w: Waiter, workers: list[WorkerView]) -> bool:
        if self.settings.admission == "none":
            return any(v.free_slots > 0 for v in workers)
        best = best_slack(workers, w.slo.name, self.target, best_effort=w.best_effort)
        return best is not None and best >= 0

    def _press(self, w: Waiter) -> None:
        """``w`` had to wait or was refused for want of slack: reserve its class (rule 2)."""
        if w.short:
            self._pressed[(w.model, w.slo.name)] = time.monotonic()

    def _ahead_can_go(self, me: Waiter, usable: list[WorkerView]) -> bool:
        """Some waiter ranked ahead of ``me``, for the same model (so ``usable`` is its list too), could go now."""
        return any(w is not me and w.model == me.model and w.rank < me.rank and self._can_go(w, self._for(w, usable))
                   for w in self.queue)

    def infeasible(self, slo: SloClass, workers: list[WorkerView]) -> bool:
        """No worker can meet the class even for a lone request (and some worker says so)."""
        return bool(workers) and not feasible_anywhere(workers, slo.name, self.target)

    def _infeasible_refusal(self, slo: SloClass, workers: list[WorkerView]) -> Refused:
        lone = [t for w in workers if (t := lone_tpot_ms(w, slo.name)) is not None]
        fastest = f"; the fastest worker serves a lone request at {min(lone):.0f} ms per token" if lone else ""
        return self._refuse(f"SLO class {slo.name!r} ({slo.tpot_ms:g} ms per token) cannot be met by any worker, "
                            f"even for a lone request{fastest}; this gateway refuses it (on_infeasible=refuse)",
                            "slo_infeasible")

    def _matched(self, me: Waiter, workers: list[WorkerView]) -> dict[str, int] | None:
        """Per worker, the leading blocks of ``me`` it is estimated to hold; None without affinity or keys."""
        if self.prefixes is None or not me.keys:
            return None
        return self.prefixes.matches([w.id for w in workers], me.keys)

    def _look(self, me: Waiter, workers: list[WorkerView], usable: list[WorkerView], *,
              over: bool) -> tuple[Choice, str] | None:
        """One look at the workers: (choice, mode) to go now, None to wait; raises Refused to refuse."""
        slo, s = me.slo, self.settings
        if s.admission == "none":
            choice = self.router.choose(workers, slo.name, self.target, keep_targets=False,
                                        matched=self._matched(me, workers))
            if choice is not None and (over or not self._ahead_can_go(me, usable)):
                return choice, "plain"
        else:
            me.best_effort = self.infeasible(slo, workers)
            if me.best_effort and s.on_infeasible == "refuse":
                raise self._infeasible_refusal(slo, workers)
            if slo.sheddable and workers:
                reserved = reserved_classes(self._pressed, self.queue, me.model, time.monotonic(), s.shed_window_s)
                workers = room_for(workers, slo.name, reserved, self.target) if reserved else workers
                if not workers:
                    raise self._refuse(f"overloaded: SLO class {slo.name!r} is sheddable and the headroom left is "
                                       f"held for waiting requests of {', '.join(sorted(reserved))}; retry later",
                                       "shed")
            choice = self.router.choose(workers, slo.name, self.target, best_effort=me.best_effort,
                                        matched=self._matched(me, workers))
            me.short = (not slo.sheddable and not me.best_effort) and (choice is None or choice.best < 0)
            if choice is not None and choice.best >= 0:
                if over or not self._ahead_can_go(me, usable):  # at its deadline it stood aside long enough
                    return choice, "best_effort" if me.best_effort else "slo"
            elif choice is not None and slo.sheddable:
                raise self._refuse(f"overloaded: no worker can meet SLO class {slo.name!r} now, and the class is "
                                   "sheddable; retry later", "shed")
            elif over and choice is not None and s.on_overload == "best-effort":
                return choice, "late"
            elif over and choice is not None:
                raise self._refuse(f"overloaded: no worker could meet SLO class {slo.name!r} within its wait "
                                   f"budget ({self.budget_s(slo, workers):g}s); retry later", "overloaded")
        if not over:
            return None
        if not workers:
            raise self._refuse("no worker is ready to serve this model", "no_workers")
        raise self._refuse("overloaded: every worker is at its request limit", "overloaded")

    def budget_s(self, slo: SloClass, workers: list[WorkerView]) -> float:
        """The request's wait budget: what its TTFT target leaves after the time from admission to a first token
        this gateway's requests of the class have recently taken (calibration.py), else the least a worker has
        recently given the class."""
        if self.settings.admission == "none":
            return self.settings.queue_timeout_s
        after = self.directory.calibration.ttft_after_admission_ms(slo.name)
        return wait_budget_s(slo, self.settings.queue_timeout_s,
                             after if after is not None else worker_ttft_ms(workers, slo.name))

    async def admit(self, slo: SloClass, *, model: str | None, exclude: set[str],
                    keys: Sequence[int] = ()) -> Admitted:
        """Where the request goes (or Refused); ``keys``: its prefix's block keys, for prefix affinity."""
        me = Waiter(slo, model, exclude, next(self._arrivals), keys)
        start = time.monotonic()
        deadline: float | None = None
        try:
            while True:
                usable = self.directory.usable(model)  # once per look: every waiter ahead has this model
                workers = self._for(me, usable)
                if deadline is None:
                    deadline = start + self.budget_s(slo, workers)
                me.saw_workers = me.saw_workers or bool(workers)
                until = deadline
                if not workers and (me.saw_workers or exclude):  # rule 6: its workers went away; wait for one
                    until = max(deadline, start + self.settings.worker_wait_s)
                got = self._look(me, workers, usable, over=time.monotonic() >= until)
                if got is not None:
                    choice, mode = got
                    return Admitted(choice, time.monotonic() - start, me in self.queue, mode)
                if me not in self.queue:
                    self._press(me)  # it must wait for slack: the sheddable leave room for its class
                    if len(self.queue) >= self.settings.max_queued:
                        raise self._refuse("overloaded: the admission queue is full", "queue_full")
                    self.queue.append(me)
                    self.metrics.queued.set(len(self.queue))
                await self._sleep(max(0.0, min(until - time.monotonic(), self.settings.refresh_s)))
        finally:  # admitted, refused, timed out or cancelled (client gone): leave, and let the others look again
            self._press(me)  # still without slack at its last look (refused, gone): the window runs from here
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
