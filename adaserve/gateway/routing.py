"""Which worker gets a request, and whether any should take it now: pure functions of the predicted TPOTs.

The **slack** of worker w for a request of class c is ``min_k 1 - TPOT_k(n) / target_k`` over c and every class
already on w, with n the requests w would hold (prediction.py): the relative margin the tightest request there
keeps if this one joins. Slack >= 0: every target should hold. A class whose target no worker can meet even
alone (lone TPOT above its target) is served best effort: its own target is left out of its slack; and a class
already on w that w cannot meet alone holds nobody back there. A worker nothing predicts (neither curve nor
cost model) is judged by the share of its slots still free.

``headroom`` (the default policy): among workers with a free slot, those that keep every target; of those within
``TIE`` of the best slack, the one with fewer requests. ``least-loaded`` and ``round-robin`` are the fallbacks a
deployment can choose, also among the workers that keep every target when some do.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

from adaserve.gateway.prediction import (
    TpotOf,
    class_tokens_at,
    feasible,
    iteration_ms_at,
    pooled_acceptance,
    predicted_tpot_ms,
)
from adaserve.gateway.view import WorkerView

TIE = 0.1  # slacks this close (share of the target) are equal; fewer requests wins


def slack(w: WorkerView, slo_class: str, tpot_of: TpotOf, *, acceptance: float | None = None,
          best_effort: bool = False) -> float:
    """min over the classes on ``w`` (this request's included, unless ``best_effort``) of 1 - TPOT / target
    if this request joined; -inf without a free slot; the free-slot share when nothing predicts TPOT. A class
    already there that ``w`` cannot meet even alone is served best effort: it holds nobody back."""
    if w.free_slots <= 0:
        return -math.inf
    n = w.active + 1
    t = iteration_ms_at(w, n, acceptance=acceptance)
    if t is None:
        return (w.free_slots - 1) / w.max_active
    others = {c for c, k in w.active_by_class.items() if k > 0 and c != slo_class}
    judged = {c for c in others if feasible(w, c, tpot_of, acceptance=acceptance)}
    if not best_effort:
        judged.add(slo_class)
    elif slo_class in w.active_by_class and feasible(w, slo_class, tpot_of, acceptance=acceptance):
        judged.add(slo_class)  # infeasible somewhere else, feasible here: those already here keep their target
    worst = 1.0
    for name in sorted(judged):
        target = tpot_of(name)
        if target:
            tpot = w.correction * t / class_tokens_at(w, name, n, acceptance=acceptance)
            worst = min(worst, 1.0 - tpot / target)
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


class Router:
    """One routing policy, with the round-robin cursor it needs."""

    def __init__(self, policy: str) -> None:
        if policy not in ("headroom", "least-loaded", "round-robin"):
            raise ValueError(f"unknown routing policy {policy!r}")
        self.policy = policy
        self._turn = itertools.count()

    def choose(self, workers: Sequence[WorkerView], slo_class: str, tpot_of: TpotOf, *,
               best_effort: bool = False, keep_targets: bool = True) -> Choice | None:
        """The policy's worker among those with a free slot, or None; its slack says whether targets hold.

        ``keep_targets``: when some worker keeps every target (slack >= 0), the policy picks among those only
        (a plain load balancer passes False)."""
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
        predicted = predicted_tpot_ms(best, slo_class, best.active + 1, acceptance=pooled_acceptance(open_))
        return Choice(best, rooms[best.id], top, predicted)
