"""How many requests a worker holds, from this gateway's side: its own requests there now and a moment ago, so that
a registration (up to a heartbeat old) is read as what it was when written, and the worker's load over time.

A registration counts every request on the worker, this gateway's included. Written at ``updated_at``, it holds
``reg - own(updated_at)`` requests of others; the worker holds those plus this gateway's own now:

    effective[c] = own_now[c] + max(0, reg[c] - own_then[c])

so a request that ended here after the worker wrote its registration no longer counts, and one that began here
since counts at once. (Without ``updated_at``, the larger of the two counts, as before.) The time integral of
the effective total gives the mean number of requests the worker held over any interval: what a finished
request's TPOT is compared with (calibration.py).
"""

from __future__ import annotations

import time
from collections import Counter, deque
from collections.abc import Mapping
from dataclasses import dataclass, field

HISTORY_S = 120.0  # own counts kept this long: registrations older than a few heartbeats have expired


def effective(reg_by_class: Mapping[str, int], own_now: Mapping[str, int],
              own_then: Mapping[str, int] | None) -> dict[str, int]:
    """Requests per class on the worker now (the rule above); ``own_then`` None: the larger count."""
    names = {*reg_by_class, *own_now}
    if own_then is None:
        return {c: max(reg_by_class.get(c, 0), own_now.get(c, 0)) for c in names}
    return {c: own_now.get(c, 0) + max(0, reg_by_class.get(c, 0) - own_then.get(c, 0)) for c in names}


@dataclass
class OwnLoad:
    """This gateway's requests on one worker, with their recent history and the worker's load integral."""

    now: Counter[str] = field(default_factory=Counter)
    history: deque[tuple[float, dict[str, int]]] = field(default_factory=deque)  # (wall s, counts from then on)
    area: float = 0.0  # integral of the worker's effective request count over monotonic seconds
    t_area: float = field(default_factory=time.monotonic)
    level: int = 0  # the effective count since t_area

    def change(self, slo_class: str, delta: int, *, wall: float | None = None) -> None:
        self.now[slo_class] = max(0, self.now[slo_class] + delta)
        wall = time.time() if wall is None else wall
        self.history.append((wall, {c: k for c, k in self.now.items() if k}))
        while len(self.history) > 1 and self.history[1][0] < wall - HISTORY_S:
            self.history.popleft()  # the newest entry older than the horizon stays: it says what held then

    def at(self, wall: float) -> dict[str, int]:
        """Own counts as they were at ``wall`` (none before the first change)."""
        counts: dict[str, int] = {}
        for t, c in self.history:
            if t > wall:
                break
            counts = c
        return counts

    def tick(self, level: int, *, now: float | None = None) -> tuple[float, float]:
        """Account for the time since the last tick at the old level, then hold ``level``; (area, now)."""
        now = time.monotonic() if now is None else now
        self.area += self.level * max(0.0, now - self.t_area)
        self.t_area, self.level = now, level
        return self.area, now


def mean_level(start: tuple[float, float], end: tuple[float, float]) -> float | None:
    """Mean request count between two ``tick`` results; None for an empty interval."""
    (a0, t0), (a1, t1) = start, end
    return (a1 - a0) / (t1 - t0) if t1 > t0 else None
