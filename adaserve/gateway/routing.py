"""Which worker gets a request, and whether any should take it now: pure functions of what workers measure.

For a request of class c that would make ``n`` requests on worker w (this one included):

    T(n)       iteration time: w's measured curve (``measured.iterations`` in its registration) at n;
               linear between points, beyond them along the curve's least-squares slope (with one point
               only, in the proportion of the cost-model prior below)
    E_c(n)     tokens a decoding request of class c gains per iteration (accepted draft tokens + the bonus
               token), from the curve's per-class figures (classes accept very differently, and AdaServe's
               selection gives tighter requests bigger trees); beyond their ends, the nearest point's. Where
               the class has no such figure: 1 + the draft tokens its finished requests had accepted per
               verification; failing that, the curve's figure over all classes, E(n)
    TPOT_c(n)  = k_w * T(n) / E_c(n)

k_w is the correction this gateway learns from its own finished requests on w: observed over predicted
TPOT (calibration.py). The **slack** of w for c is ``min_k 1 - TPOT_k(n) / target_k`` over c and every class
already on w: the relative margin the tightest request there keeps if this one joins. Slack >= 0: every
target should hold. A class whose target no worker can meet even alone (lone TPOT above its target) is served
best effort: its own target is left out of its slack; and a class already on w that w cannot meet alone holds
nobody back there.

Before a worker has measured anything (no curve point with ``MIN_STEPS`` iterations), the prior is the
analytic model of its published cost model: one iteration verifies B tokens and drafts D steps,
``T = T_target(n*L, max(B, n)) + D * T_draft(n*L, n)``, and a request gains ``1 + a (1 - a^k) / (1 - a)``
tokens, ``k = min(D, B/n - 1)`` (L: its mean context per request, else 512; D: its ``max_depth``, else 4;
a: the acceptance rate pooled over workers, else 0.6). A worker with neither curve nor cost model is judged
by the share of its slots still free. Workers within ``TIE`` of the best slack count as equal, and the one
with fewer requests wins; ``least-loaded`` and ``round-robin`` are the fallbacks a deployment can choose.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

CONTEXT_TOKENS = 512  # L when the worker reports none: KV tokens a typical request reads per iteration
DRAFT_STEPS = 4  # D when the worker reports none: the engine's default d_max (engine/adaptive.py)
PRIOR_ACCEPTANCE = 0.6  # a before a worker has verified anything
MIN_STEPS = 4  # iterations a curve point needs before it is trusted
MIN_DECODES = 4  # request-iterations of a class a curve point needs before its figure for the class is trusted
TIE = 0.1  # slacks this close (share of the target) are equal; fewer requests wins

TpotOf = Callable[[str], float | None]


@dataclass(frozen=True)
class CurvePoint:
    """One point of a worker's measured iteration-time curve (contract: ``IterationPoint``)."""

    requests: int
    steps: int
    iteration_ms: float
    tokens_per_request: float | None = None
    tokens_by_class: dict[str, tuple[float, int]] = field(default_factory=dict)  # class -> (tokens, decodes)


@dataclass(frozen=True)
class WorkerView:
    """A worker as routing sees it: its registration, this gateway's own requests on it, its correction."""

    id: str
    address: str
    status: str
    model: str | None
    max_active: int
    active: int
    active_by_class: dict[str, int] = field(default_factory=dict)
    budget: int | None = None
    target_cost: dict[str, float] | None = None
    draft_cost: dict[str, float] | None = None
    acceptance_rate: float | None = None
    context_per_request: float | None = None  # L as the worker last reported it
    draft_steps: int | None = None  # D as the worker reports it (0: it does not speculate)
    unloaded_tpot_ms: float | None = None  # one target forward of one token (the profile's)
    lone_tpot_ms: float | None = None  # a lone request's TPOT as served, measured at warm-up
    curve: tuple[CurvePoint, ...] = ()  # ascending requests
    class_accepted: dict[str, float] = field(default_factory=dict)  # accepted per verification, per class
    class_ttft_ms: dict[str, float] = field(default_factory=dict)  # least recent TTFT per class, at the worker
    correction: float = 1.0  # k_w: observed / predicted TPOT, learnt by this gateway

    @property
    def free_slots(self) -> int:
        return self.max_active - self.active

    @property
    def depth(self) -> int:
        """D: draft steps per iteration (0 without a draft model)."""
        if self.draft_cost is None:
            return 0
        return DRAFT_STEPS if self.draft_steps is None else self.draft_steps


# ---- the prior: the analytic model of the published cost model -----------------------------------------


def _cost(model: dict[str, float], n_context: int, n_batched: int) -> float:
    # the worker's roofline fit: T = alpha * context + gamma * batched + delta (engine/cost_model.py)
    return model["alpha"] * n_context + model["gamma"] * n_batched + model["delta"]


def iteration_s(w: WorkerView, n: int) -> float | None:
    """The prior's iteration time in seconds with ``n`` requests; None without a cost model and budget."""
    if w.target_cost is None or w.budget is None:
        return None
    n = max(1, n)
    ctx = round(n * (w.context_per_request or CONTEXT_TOKENS))
    if w.depth == 0 or w.draft_cost is None:  # no draft cost is depth 0 already; the 2nd test narrows the type
        return _cost(w.target_cost, ctx, n)
    return _cost(w.target_cost, ctx, max(w.budget, n)) + w.depth * _cost(w.draft_cost, ctx, n)


def accepted_per_request(a: float, k: float) -> float:
    """Expected tokens a chain of ``k`` draft tokens gets accepted, each with probability ``a`` in turn."""
    if k <= 0:
        return 0.0
    if a >= 1.0:
        return k
    return a * (1.0 - a**k) / (1.0 - a)


def prior_tokens(w: WorkerView, n: int, acceptance: float | None) -> float:
    """The prior's tokens per request per iteration: the bonus token plus an accepted chain of the tree's depth."""
    if w.depth == 0 or w.budget is None:
        return 1.0
    k = min(w.depth, w.budget / max(1, n) - 1.0)
    a = next((x for x in (acceptance, w.acceptance_rate) if x is not None), PRIOR_ACCEPTANCE)
    return 1.0 + accepted_per_request(a, k)


def pooled_acceptance(workers: Sequence[WorkerView]) -> float | None:
    rates = [w.acceptance_rate for w in workers if w.acceptance_rate is not None]
    return sum(rates) / len(rates) if rates else None


# ---- the measured curve ------------------------------------------------------------------------------------


def trusted(curve: Sequence[CurvePoint]) -> list[CurvePoint]:
    return [p for p in curve if p.steps >= MIN_STEPS]


def curve_slope(points: Sequence[CurvePoint]) -> float | None:
    """Least-squares ms per extra request over the points, weighted by their iterations (>= 0); None below
    two distinct request counts."""
    if len({p.requests for p in points}) < 2:
        return None
    wsum = sum(p.steps for p in points)
    mx = sum(p.steps * p.requests for p in points) / wsum
    my = sum(p.steps * p.iteration_ms for p in points) / wsum
    sxx = sum(p.steps * (p.requests - mx) ** 2 for p in points)
    sxy = sum(p.steps * (p.requests - mx) * (p.iteration_ms - my) for p in points)
    return max(0.0, sxy / sxx)


def _around(points: Sequence[CurvePoint], n: float) -> tuple[CurvePoint | None, CurvePoint | None]:
    """The last point at or below ``n`` and the first at or above it."""
    lo = next((p for p in reversed(points) if p.requests <= n), None)
    hi = next((p for p in points if p.requests >= n), None)
    return lo, hi


def _between(lo: CurvePoint, hi: CurvePoint, n: float, y: Callable[[CurvePoint], float]) -> float:
    if hi.requests == lo.requests:
        return y(lo)
    f = (n - lo.requests) / (hi.requests - lo.requests)
    return y(lo) + f * (y(hi) - y(lo))


def iteration_ms_at(w: WorkerView, n: float, *, acceptance: float | None = None) -> float | None:
    """T(n) in ms (``n`` may be fractional: a mean over a request's life); None when nothing predicts it."""
    points = trusted(w.curve)
    prior = iteration_s(w, round(n))
    if not points:
        return None if prior is None else 1e3 * prior
    lo, hi = _around(points, n)
    if lo is not None and hi is not None:
        return _between(lo, hi, n, lambda p: p.iteration_ms)
    edge = lo if lo is not None else hi
    assert edge is not None
    slope = curve_slope(points)
    if slope is not None:
        return max(edge.iteration_ms + slope * (n - edge.requests), 0.5 * edge.iteration_ms)
    prior_edge = iteration_s(w, edge.requests)
    if prior is not None and prior_edge:  # one point: scaled as the prior scales
        return edge.iteration_ms * prior / prior_edge
    return edge.iteration_ms * max(n, 1.0) / edge.requests  # no prior: in proportion to the requests


def _along(points: Sequence[CurvePoint], n: float, y: Callable[[CurvePoint], float]) -> float:
    """``y`` along the points at ``n``: linear between them, the nearest one's beyond their ends."""
    lo, hi = _around(points, n)
    if lo is not None and hi is not None:
        return _between(lo, hi, n, y)
    edge = lo if lo is not None else hi
    assert edge is not None
    return y(edge)


def tokens_at(w: WorkerView, n: float, *, acceptance: float | None = None) -> float:
    """E(n): tokens a decoding request (any class) gains per iteration, >= 1."""
    points = [p for p in trusted(w.curve) if p.tokens_per_request is not None]
    if not points:
        return prior_tokens(w, round(n), acceptance)
    return max(1.0, _along(points, n, lambda p: p.tokens_per_request or 0.0))


def class_tokens_at(w: WorkerView, slo_class: str, n: float, *, acceptance: float | None = None) -> float:
    """E_c(n): tokens a decoding request of the class gains per iteration, >= 1."""
    points = [p for p in w.curve if p.tokens_by_class.get(slo_class, (0.0, 0))[1] >= MIN_DECODES]
    if points:
        return max(1.0, _along(points, n, lambda p: p.tokens_by_class[slo_class][0]))
    if slo_class in w.class_accepted:  # what its finished requests gained per verification, whatever the load
        return 1.0 + w.class_accepted[slo_class]
    return tokens_at(w, n, acceptance=acceptance)


def predicted_tpot_ms(w: WorkerView, slo_class: str, n: float, *, acceptance: float | None = None) -> float | None:
    """TPOT_c(n) before the correction k_w; None when the worker has neither curve nor cost model."""
    t = iteration_ms_at(w, n, acceptance=acceptance)
    if t is None:
        return None
    return t / class_tokens_at(w, slo_class, n, acceptance=acceptance)


def lone_tpot_ms(w: WorkerView, slo_class: str, *, acceptance: float | None = None) -> float | None:
    """What a lone request of the class gets on ``w``: corrected TPOT at n = 1."""
    raw = predicted_tpot_ms(w, slo_class, 1, acceptance=acceptance)
    return None if raw is None else w.correction * raw


def feasible(w: WorkerView, slo_class: str, tpot_of: TpotOf, *, acceptance: float | None = None) -> bool | None:
    """Can ``w`` meet the class's target for a lone request? None: nothing predicts it."""
    target, lone = tpot_of(slo_class), lone_tpot_ms(w, slo_class, acceptance=acceptance)
    if target is None or lone is None:
        return None
    return lone <= target


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
