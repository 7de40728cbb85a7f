"""The simulated clock: real models, real tokens, real trees; time from a device model.

    per iteration:  the engine steps as usual (the draft's beam search, selection, one target forward);
                    every forward advances the clock by device.draft / device.target .seconds(n_new, n_context)
                    and the scheduler's own time is charged once per iteration (a fixed figure, or the
                    host time the step took outside its forwards when ``sched_s`` is None)
    between:        with nothing to do the clock jumps to the next arrival

Every timestamp the engine takes (arrival, first token, every token) reads this clock, so TTFT, TPOT,
attainment and goodput are in simulated seconds. With a fixed scheduler figure nothing reads the wall
clock: the same workload and seed give the same numbers, whatever else the machine is doing
(docs/architecture.md §13).
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

from adaserve.bench.sim.device_model import DeviceProfile, ForwardCost
from adaserve.engine.engine import Engine, TokenEvent
from adaserve.engine.model.runner import ForwardRecord, ModelRunner
from adaserve.engine.request import Request

# a finished request's id and when it finished (seconds from the run's start) -> arrivals it brings
FollowUp = Callable[[str, float], list[tuple[float, Request]]]


@dataclass
class SimClock:
    now_s: float = 0.0

    def __call__(self) -> float:
        return self.now_s

    def advance(self, seconds: float) -> None:
        if not seconds >= 0:
            raise ValueError(f"the clock only moves forward, got {seconds!r}")
        self.now_s += seconds

    def advance_to(self, t: float) -> None:
        self.now_s = max(self.now_s, t)


@dataclass
class SimTotals:
    """Where the simulated time went, and the host time it took to simulate."""

    target_s: float = 0.0
    draft_s: float = 0.0
    sched_s: float = 0.0
    idle_s: float = 0.0
    iterations: int = 0
    forwards_wall_s: float = 0.0  # host time inside forwards (wall clock; not part of any result)
    per_step_s: list[float] = field(default_factory=list)  # simulated duration of every iteration

    @property
    def busy_s(self) -> float:
        return self.target_s + self.draft_s + self.sched_s


def _charger(clock: SimClock, cost: ForwardCost, totals: SimTotals, kind: str) -> Callable[[ForwardRecord], None]:
    def charge(rec: ForwardRecord) -> None:
        dt = cost.seconds(rec.n_new, rec.n_context)
        clock.advance(dt)
        setattr(totals, kind, getattr(totals, kind) + dt)
        totals.forwards_wall_s += rec.wall_s

    return charge


@contextmanager
def priced(target: ModelRunner, draft: ModelRunner | Sequence[ModelRunner] | None, device: DeviceProfile,
           clock: SimClock, totals: SimTotals, draft_costs: Sequence[ForwardCost] | None = None) -> Iterator[None]:
    """While inside, every forward of these runners advances ``clock`` by the device's price.

    ``draft_costs``: one price per draft (several drafts, or a draft that is not the profile's own);
    by default the one draft is priced as the device's draft."""
    drafts = [] if draft is None else [draft] if isinstance(draft, ModelRunner) else list(draft)
    costs = list(draft_costs) if draft_costs is not None else [device.draft]
    if len(drafts) > len(costs):
        raise ValueError(f"{len(drafts)} drafts need a price each, got {len(costs)}")
    pairs = [(target, _charger(clock, device.target, totals, "target_s"))]
    for d, cost in zip(drafts, costs, strict=False):
        pairs.append((d, _charger(clock, cost, totals, "draft_s")))
    for runner, fn in pairs:
        runner.forward_listeners.append(fn)
    try:
        yield
    finally:
        for runner, fn in pairs:
            runner.forward_listeners.remove(fn)


def run_simulated(engine: Engine, arrivals: list[tuple[float, Request]], device: DeviceProfile, clock: SimClock, *,
                  sched_s: float | None, on_step: Callable[[list[TokenEvent]], None] | None = None,
                  draft_costs: Sequence[ForwardCost] | None = None,
                  follow_up: FollowUp | None = None) -> SimTotals:
    """Serve ``arrivals`` (offsets in simulated seconds from now) on ``engine``, whose clock must be ``clock``.

    ``sched_s``: the scheduler's time per iteration; None charges what the host measured outside the
    forwards (realistic for this machine, but then the result depends on how busy it is).
    ``follow_up(request_id, t)``: called when a request finishes, ``t`` seconds after the start; the arrivals
    it returns join the schedule (a conversation's next turn, bench/multi_turn.py).
    """
    if engine.clock is not clock:
        raise ValueError("the engine must read the simulated clock it is run on")
    totals = SimTotals()
    # (offset, order, request): ties keep the order they were given or made in
    pending = [(t, i, r) for i, (t, r) in enumerate(sorted(arrivals, key=lambda a: a[0]))]
    made = len(pending)
    start = clock()
    with priced(engine.target, engine.drafts, device, clock, totals, draft_costs):
        while pending or engine.has_work:
            while pending and pending[0][0] <= clock() - start:
                engine.add_request(heapq.heappop(pending)[2])
            if not engine.has_work:
                before = clock()
                clock.advance_to(start + pending[0][0])
                totals.idle_s += clock() - before
                continue
            t_sim, t_wall, fwd_wall = clock(), time.perf_counter(), totals.forwards_wall_s
            events = engine.step()
            overhead = sched_s if sched_s is not None else max(
                0.0, (time.perf_counter() - t_wall) - (totals.forwards_wall_s - fwd_wall))
            clock.advance(overhead)
            totals.sched_s += overhead
            totals.iterations += 1
            totals.per_step_s.append(clock() - t_sim)
            if follow_up is not None:
                for e in events:
                    if e.finished:
                        for t, req in follow_up(e.request_id, clock() - start):
                            heapq.heappush(pending, (t, made, req))
                            made += 1
            if on_step is not None:
                on_step(events)
    return totals
