"""The TPOT a request of a class would get on a worker: pure functions of what the worker measured.

For a request of class c on worker w when w holds ``n`` requests (this one included):

    T_c(n)     iteration time: w's measured curve (``measured.iterations`` in its registration) at n, each
               point's time that of its iterations with a request of class c in them where c has a figure
               there (a class's context is part of an iteration's cost: on a small model a lone summary's
               iteration costs more than a lone question's, so one curve for all would misjudge both), the
               point's time over all classes where it has not; linear between points, beyond them along the
               least-squares slope (with one point only, in the proportion of the cost-model prior below)
    E_c(n)     tokens a decoding request of class c gains per iteration (accepted draft tokens + the bonus
               token), from the curve's per-class figures (classes accept very differently, and AdaServe's
               selection gives tighter requests bigger trees); beyond their ends, the nearest point's (the
               worker seeds its one-request point with each class's lone request at warm-up, so a class's
               lone figure stays its own under load). Where the class has no such figure: 1 + the draft
               tokens its finished requests had accepted per verification; failing that, the curve's figure
               over all classes, E(n)
    TPOT_c(n)  = k_w * T_c(n) / E_c(n)

k_w is the correction this gateway learns from its own finished requests on w: observed over predicted
TPOT (calibration.py). ``predicted_tpot_ms`` is the prediction before it.

Before a worker has measured anything (no curve point with ``MIN_STEPS`` iterations), the prior is the
analytic model of its published cost model: one iteration verifies B tokens and drafts D steps,
``T = T_target(n*L, max(B, n)) + D * T_draft(n*L, n)``, and a request gains ``1 + a (1 - a^k) / (1 - a)``
tokens, ``k = min(D, B/n - 1)`` (L: its mean context per request, else 512; D: its ``max_depth``, else 4;
a: the acceptance rate pooled over workers, else 0.6).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace

from adaserve.gateway.view import CurvePoint, WorkerView

CONTEXT_TOKENS = 512  # L when the worker reports none: KV tokens a typical request reads per iteration
PRIOR_ACCEPTANCE = 0.6  # a before a worker has verified anything
MIN_STEPS = 4  # iterations a curve point needs before it is trusted
MIN_DECODES = 4  # request-iterations of a class a curve point needs before its figure for the class is trusted

TpotOf = Callable[[str], float | None]


# ---- the prior: the analytic model of the published cost model -----------------------------------------


def _cost(model: dict[str, float], n_context: int, n_batched: int, n_sequences: int) -> float:
    # the worker's roofline fit: T = alpha * context + gamma * batched + delta, with the attention cells' beta where
    # published: each request's m = batched / n tokens read its context and one another's as a causal chunk
    # (engine/cost/cost_model.even_cells, which the gateway may not import; tests/gateway hold the two together)
    m = n_batched / n_sequences
    cells = n_context * m + n_batched * (m + 1) / 2
    return model["alpha"] * n_context + model["gamma"] * n_batched + model["delta"] + model.get("beta", 0.0) * cells


def iteration_s(w: WorkerView, n: int) -> float | None:
    """The prior's iteration time in seconds with ``n`` requests; None without a cost model and budget."""
    if w.target_cost is None or w.budget is None:
        return None
    n = max(1, n)
    ctx = round(n * (w.context_per_request or CONTEXT_TOKENS))
    if w.depth == 0 or w.draft_cost is None:  # no draft cost is depth 0 already; the 2nd test narrows the type
        return _cost(w.target_cost, ctx, n, n)
    return _cost(w.target_cost, ctx, max(w.budget, n), n) + w.depth * _cost(w.draft_cost, ctx, n, n)


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


def class_curve(curve: Sequence[CurvePoint], slo_class: str) -> list[CurvePoint]:
    """The trusted points, each with its time with a request of the class in it where the class has a figure."""
    def own(p: CurvePoint) -> CurvePoint:
        ms = p.ms_by_class.get(slo_class)
        if ms is None or p.tokens_by_class.get(slo_class, (0.0, 0))[1] < MIN_DECODES:
            return p
        return replace(p, iteration_ms=ms)

    return [own(p) for p in trusted(curve)]


def iteration_ms_at(w: WorkerView, n: float, *, acceptance: float | None = None,
                    slo_class: str | None = None) -> float | None:
    """T(n) in ms, or T_c(n) given the class (``n`` may be fractional: a mean over a request's life); None when
    nothing predicts it."""
    points = trusted(w.curve) if slo_class is None else class_curve(w.curve, slo_class)
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
    t = iteration_ms_at(w, n, acceptance=acceptance, slo_class=slo_class)
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
