"""Which worker gets a request: pure functions of the workers' published state.

``headroom`` (the default) asks of each worker: if this request joined, could the budget still keep
every request on its TPOT target? The worker publishes its token budget B, the cost model of its
forwards and its recent acceptance rate; the gateway knows each class's target.

    n         = requests on the worker, this one included
    t         = T_target(n*L, B) + D * T_draft(n*L, n)     one iteration: verify B tokens, D draft steps
    k         = min(D, B/n - 1)                             draft tokens each request's tree gets on average
    m         = a (1 - a^k) / (1 - a)                       tokens a chain of k accepts, acceptance rate a
    need_r    = t / T_r                                     tokens request r must gain per iteration
    headroom  = m - mean_r max(0, need_r - 1)               every request gets its bonus token free

(L: the mean context, prompt + output, of the requests the worker holds, as its registration reports,
else a typical 512; D: the worker's deepest tree, ``max_depth`` in its registration, else 4; a: the
acceptance rate pooled over the candidate workers, since it belongs to the model pair and the traffic,
and one worker's recent window is noisy enough to send it all the traffic or none.) A request whose own need
exceeds what a tree can give (1 + k) has no headroom on that worker. Headroom >= 0 means the batch
should still meet every target. Workers whose headroom is within ``TIE`` tokens of the best count as
equal, and the one with fewer requests wins: headroom estimates are not precise enough to send every
request to one worker for a hundredth of a token. Workers without a cost model are judged by their free
slots only; ``least-loaded`` and ``round-robin`` are the fallbacks a deployment can choose.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

CONTEXT_TOKENS = 512  # L when the worker reports none: KV tokens a typical request reads per iteration
DRAFT_STEPS = 4  # D when the worker reports none: the engine's default d_max (engine/adaptive.py)
PRIOR_ACCEPTANCE = 0.6  # a before a worker has verified anything
TIE = 0.25  # headrooms this close (tokens per request per iteration) are equal; fewer requests wins


@dataclass(frozen=True)
class WorkerView:
    """A worker as routing sees it: its registration plus this gateway's own requests in flight on it."""

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
    unloaded_tpot_ms: float | None = None  # a lone request's time per token without speculation

    @property
    def free_slots(self) -> int:
        return self.max_active - self.active

    @property
    def depth(self) -> int:
        """D: draft steps per iteration (0 without a draft model)."""
        if self.draft_cost is None:
            return 0
        return DRAFT_STEPS if self.draft_steps is None else self.draft_steps


def _cost(model: dict[str, float], n_context: int, n_batched: int) -> float:
    # the worker's roofline fit: T = alpha * context + gamma * batched + delta (engine/cost_model.py)
    return model["alpha"] * n_context + model["gamma"] * n_batched + model["delta"]


def iteration_s(w: WorkerView, n: int) -> float | None:
    if w.target_cost is None or w.budget is None:
        return None
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


def pooled_acceptance(workers: list[WorkerView]) -> float | None:
    rates = [w.acceptance_rate for w in workers if w.acceptance_rate is not None]
    return sum(rates) / len(rates) if rates else None


def headroom(w: WorkerView, tpot_ms: float, tpot_of: Callable[[str], float | None], *,
             acceptance: float | None = None) -> float:
    """Spare accepted tokens per request per iteration if a request with target ``tpot_ms`` joined ``w``.

    ``acceptance``: the rate to assume (pooled over workers); default the worker's own.
    """
    if w.free_slots <= 0:
        return float("-inf")
    n = w.active + 1
    t = iteration_s(w, n)
    if t is None or w.budget is None:  # no cost model (a t implies a budget; the 2nd test narrows the type):
        # the share of slots still free after joining
        return (w.free_slots - 1) / w.max_active
    k = 0.0 if w.depth == 0 else min(w.depth, w.budget / n - 1.0)
    a = next((x for x in (acceptance, w.acceptance_rate) if x is not None), PRIOR_ACCEPTANCE)
    m = accepted_per_request(a, k)
    own_need = t / (tpot_ms / 1e3)
    extra = max(0.0, own_need - 1.0)
    for name, count in w.active_by_class.items():
        target = tpot_of(name)
        if target:
            extra += count * max(0.0, t / (target / 1e3) - 1.0)
    return min(m - extra / n, 1.0 + max(k, 0.0) - own_need)


def _open(workers: list[WorkerView]) -> list[WorkerView]:
    """The workers with a free slot, in id order (the order also fixes the pooled acceptance's sum)."""
    return sorted((w for w in workers if w.free_slots > 0), key=lambda w: w.id)


def _headrooms(open_: list[WorkerView], tpot_ms: float, tpot_of: Callable[[str], float | None]) -> dict[str, float]:
    a = pooled_acceptance(open_)
    return {w.id: headroom(w, tpot_ms, tpot_of, acceptance=a) for w in open_}


def best_headroom(workers: list[WorkerView], tpot_ms: float, tpot_of: Callable[[str], float | None]) -> float | None:
    """The fleet's best headroom for a request with target ``tpot_ms`` (what ``Router.choose`` reports as
    ``best_headroom``, whatever the policy), or None when no worker has a free slot. Pure: moves no cursor."""
    rooms = _headrooms(_open(workers), tpot_ms, tpot_of)
    return max(rooms.values()) if rooms else None


@dataclass(frozen=True)
class Choice:
    worker: WorkerView
    headroom: float  # the chosen worker's
    best_headroom: float  # the fleet's best: below 0, no worker should meet this request's target


class Router:
    """One routing policy, with the round-robin cursor it needs."""

    def __init__(self, policy: str) -> None:
        if policy not in ("headroom", "least-loaded", "round-robin"):
            raise ValueError(f"unknown routing policy {policy!r}")
        self.policy = policy
        self._turn = itertools.count()

    def choose(self, workers: list[WorkerView], tpot_ms: float,
               tpot_of: Callable[[str], float | None]) -> Choice | None:
        """The best worker with a free slot, or None. Its headroom says whether the SLO should hold."""
        open_ = _open(workers)
        if not open_:
            return None
        rooms = _headrooms(open_, tpot_ms, tpot_of)
        top = max(rooms.values())  # = best_headroom(workers, tpot_ms, tpot_of)
        if self.policy == "headroom":
            best = min((w for w in open_ if rooms[w.id] >= top - TIE), key=lambda w: (w.active, -rooms[w.id]))
        elif self.policy == "least-loaded":
            best = min(open_, key=lambda w: (w.active / w.max_active, w.active))
        else:
            best = open_[next(self._turn) % len(open_)]
        return Choice(best, rooms[best.id], top)
