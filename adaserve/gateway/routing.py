"""Which worker gets a request, and whether any should take it now: pure functions of the predicted TPOTs.

The **slack** of worker w for a request of class c is ``min_k 1 - TPOT_k(n) / target_k`` over c and every class
already on w, with n the requests w would hold (prediction.py): the relative margin the tightest request there
keeps if this one joins. Slack >= 0: every target should hold. A class whose target w cannot meet even alone
(lone TPOT above its target) is served best effort there: held to what a lone request of it gets on w, plus
``BEST_EFFORT_ROOM``, instead of its target. Served as well as w can serve it, and no worse: leaving its target
out instead let it join batches of four to eight on a 2-core CPU at twice its lone TPOT, where none met its
target (docs/results/loadtest-cpu-smollm2-admission-4.json, coding at 2x), though served alone most would have.
A worker nothing predicts (neither curve nor cost model) is judged by the share of its slots still free.

``headroom`` (the default policy): among workers with a free slot, those that keep every target; of those within
``TIE`` of the best slack, the one with fewer requests. ``least-loaded`` and ``round-robin`` are the fallbacks a
deployment can choose, also among the workers that keep every target when some do.

Prefix affinity (prefix_index.py, on unless ``prefix_index_blocks=0``): given how many leading blocks of the
request each worker is estimated to hold, the policy's pick gives way to the worker with headroom (slack >= 0)
that holds the longest prefix; a worker without headroom is never chosen for its prefix.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from adaserve.gateway.prediction import (
    TpotOf,
    feasible,
    iteration_ms_at,
    lone_tpot_ms,
    pooled_acceptance,
    predicted_tpot_ms,
)
from adaserve.gateway.prefix_index import Preference, prefer
from adaserve.gateway.view import WorkerView

TIE = 0.1  # slacks this close (share of the target) are equal; fewer requests wins
BEST_EFFORT_ROOM = 0.1  # a class a worker cannot meet alone is held there to its lone TPOT plus this share


def limit_ms(w: WorkerView, slo_class: str, tpot_of: TpotOf, *, acceptance: float | None = None) -> float | None:
    """What the class's predicted TPOT on ``w`` is held to: its target where ``w`` can meet it alone; where it
    cannot (best effort), what ``w`` gives a lone request of it, plus ``BEST_EFFORT_ROOM``: served as well as
    ``w`` can, not slowed further by others. None: the class has no target here."""
    target = tpot_of(slo_class)
    if not target:
        return None
    lone = lone_tpot_ms(w, slo_class, acceptance=acceptance)
    return lone * (1.0 + BEST_EFFORT_ROOM) if lone is not None and lone > target else target


def slack(w: WorkerView, slo_class: str, tpot_of: TpotOf, *, acceptance: float | None = None,
          best_effort: bool = False) -> float:
    """min over the classes on ``w``, this request's included, of 1 - TPOT / limit if this request joined: the
    classes already there each by its ``limit_ms``; this request by its target, or, ``best_effort`` (no worker
    can meet the class alone), by its ``limit_ms`` here too. -inf without a free slot; the free-slot share when
    nothing predicts TPOT."""
    if w.free_slots <= 0:
        return -math.inf
    n = w.active + 1
    if iteration_ms_at(w, n, acceptance=acceptance) is None:
        return (w.free_slots - 1) / w.max_active
    judged = {c for c, k in w.active_by_class.items() if k > 0} | {slo_class}
    worst = 1.0
    for name in sorted(judged):
        own = name == slo_class and not best_effort  # (limit_ms is never below the target: the stricter one)
        limit = tpot_of(name) if own else limit_ms(w, name, tpot_of, acceptance=acceptance)
        raw = predicted_tpot_ms(w, name, n, acceptance=acceptance)
        if limit and raw is not None:
            worst = min(worst, 1.0 - w.correction * raw / limit)
    return worst


# ---- the choice -------------------------------------------------------------------------------------------------


def _open(workers: Sequence[WorkerView]) -> list[WorkerView]:
    """The workers with a free slot, in id order (the order also fixes the pooled acceptance's sum)."""
    return sorted((w for w in workers if w.free_slots > 0), key=lambda w: w.id)


def _slacks(open_: list[WorkerView], slo_class: str, tpot_of: TpotOf, best_effort: bool) -> dict[str, float]:
    a = pooled_acceptance(open_)
    return {w.id: slack(w, slo_class, tpot_of, acceptance=a, best_effort=best_effort) for w in open_}


def best_slack(workers: Sequence[WorkerView], slo_class: str, tpot_of: TpotOf, *,
               best_effort: bool = False) -> float | None:
    """The fleet's best slack for the class (what ``Router.choose`` reports as ``best``, whatever the policy),
    or None when no worker has a free slot. Pure: moves no cursor."""
    rooms = _slacks(_open(workers), slo_class, tpot_of, best_effort)
    return max(rooms.values()) if rooms else None


def with_one_more(w: WorkerView, slo_class: str) -> WorkerView:
    """``w`` as it would be with one more request of the class on it."""
    by_class = {**w.active_by_class, slo_class: w.active_by_class.get(slo_class, 0) + 1}
    return replace(w, active=w.active + 1, active_by_class=by_class)


def room_for(workers: Sequence[WorkerView], slo_class: str, reserved: set[str], tpot_of: TpotOf) -> list[WorkerView]:
    """The workers a request of ``slo_class`` may join and still leave room for one request of each ``reserved``
    class: after it joined, that one request would have slack there. A reserved class a worker cannot meet even
    alone holds no room on it (it would hold the worker for nothing)."""
    a = pooled_acceptance(sorted(workers, key=lambda w: w.id))
    return [w for w in workers
            if all(slack(with_one_more(w, slo_class), c, tpot_of, acceptance=a) >= 0 for c in sorted(reserved)
                   if feasible(w, c, tpot_of, acceptance=a) is not False)]


def feasible_anywhere(workers: Sequence[WorkerView], slo_class: str, tpot_of: TpotOf) -> bool:
    """Some worker (busy or not) can meet the class for a lone request, or none can be judged."""
    a = pooled_acceptance(sorted(workers, key=lambda w: w.id))
    verdicts = [feasible(w, slo_class, tpot_of, acceptance=a) for w in workers]
    return any(v is None or v for v in verdicts) or not verdicts


@dataclass(frozen=True)
class Choice:
    worker: WorkerView
    slack: float  # the chosen worker's
    best: float  # the fleet's best: below 0, no worker should meet this request's target now
    predicted_tpot_ms: float | None  # the request's own TPOT on the chosen worker, before the correction
    prefix: Preference | None = None  # what prefix affinity did, when the request had blocks to match


class Router:
    """One routing policy, with the round-robin cursor it needs."""

    def __init__(self, policy: str) -> None:
        if policy not in ("headroom", "least-loaded", "round-robin"):
            raise ValueError(f"unknown routing policy {policy!r}")
        self.policy = policy
        self._turn = itertools.count()

    def choose(self, workers: Sequence[WorkerView], slo_class: str, tpot_of: TpotOf, *,
               best_effort: bool = False, keep_targets: bool = True,
               matched: Mapping[str, int] | None = None) -> Choice | None:
        """The policy's worker among those with a free slot, or None; its slack says whether targets hold.

        ``keep_targets``: when some worker keeps every target (slack >= 0), the policy picks among those only
        (a plain load balancer passes False). ``matched``: worker id -> leading blocks of the request it is
        estimated to hold (prefix_index.py); the worker with headroom holding the most is preferred."""
        open_ = _open(workers)
        if not open_:
            return None
        rooms = _slacks(open_, slo_class, tpot_of, best_effort)
        top = max(rooms.values())  # = best_slack(...)
        pool = [w for w in open_ if rooms[w.id] >= 0] if keep_targets and top >= 0 else open_
        if self.policy == "headroom":
            best = min((w for w in pool if rooms[w.id] >= top - TIE), key=lambda w: (w.active, -rooms[w.id]))
        elif self.policy == "least-loaded":
            best = min(pool, key=lambda w: (w.active / w.max_active, w.active))
        else:
            best = pool[next(self._turn) % len(pool)]
        preference = None
        if matched:
            preference = prefer(best, pool, rooms, matched, everyone=workers)
            best = preference.worker
        predicted = predicted_tpot_ms(best, slo_class, best.active + 1, acceptance=pooled_acceptance(open_))
        return Choice(best, rooms[best.id], top, predicted, preference)
