"""This iteration's verification budget: as many tokens as pay for themselves (docs/architecture.md §5).

The profiled knee B is what one forward carries for (almost) the price of one token. It is a floor, not a
ceiling: when a batch's candidate trees hold more likely tokens than B, verifying more of them can still
raise tokens per second, and a fixed chain (which ignores B) would do so. Once the draft has built the
candidates, their path probabilities say what each extra verified token is worth:

    order all drafted nodes by f(v) (the draft's path probability), highest first (parents come first)
    E(k) = n + sum of the top k - n values of f        expected tokens emitted if k are verified
                                                      (each of the n roots yields the bonus token)
    T(k) = t_spent + t_target(k)                       the iteration's time: draft + scheduler + forward
    B    = max(B_knee, argmax_k E(k) / T(k))           for n <= k <= every candidate node

E/T is the iteration's expected goodput; B never falls below the knee, where extra tokens are free.

That rule ("goodput") knows nothing of SLOs, and every token it adds lengthens the iteration, which raises
every request's A(r) = (l_r + T) / tpot_r - o_r. The SLO rule ("slo", ``slo_budget``) prices B against
the batch's targets, the way Algorithm 2 orders its own two phases: SLO first, then throughput.

    for B on a grid from n (roots only) to every candidate node:
        T(B)       = t_spent + t_target(B)                   the iteration if B tokens are verified
        A_r(B)     = A_r(T(B)) + margin_r                    what r must emit (selection.slo_requirement)
        on_slo(B)  = #{ r : the SLO phase at B grants r its whole wish for A_r(B),
                            and r's best tree can reach A_r(T(B)) at all }
    B = argmax_B (on_slo(B), E(B) / T(B))                    most requests on target, then goodput

So B grows while the extra tokens keep requests on target or raise tokens per second without pushing
any request off its target, and shrinks when a shorter iteration is what keeps requests on target (a
summarisation request with slack needs no tree; every token it does not verify shortens everyone's
iteration). Hopeless requests (A(r) beyond their best tree even at the shortest T) do not pull B up.
Pure: numpy and a cost callback.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from adaserve.engine.model.tree import TokenTree
from adaserve.engine.speculation.selection import RankedNodes, slo_grants, slo_wishes, strict_log_probs

# B candidates the SLO rule prices: this many evenly spaced steps from the roots to every candidate node
SLO_BUDGET_STEPS = 16
# tokens over which token_price reads the cost curve's slope at B
PRICE_STEP = 16


def drafted_values(cands: Sequence[TokenTree]) -> np.ndarray:
    """Every drafted node's f(v) over the batch, highest first: the ordering E(k) sums (module docstring).
    The budget rules and the price read the same array; the engine sorts it once per iteration."""
    return np.sort(np.concatenate([np.exp(c.log_probs[1:]) for c in cands]))[::-1]


def goodput_budget(cands: Sequence[TokenTree], *, floor: int, t_spent_s: float,
                   t_target: Callable[[int], float], values: np.ndarray | None = None) -> int:
    """B for this iteration (see the module docstring); ``t_target(k)``: seconds to verify k tokens;
    ``values``: ``drafted_values(cands)`` if already computed."""
    n = len(cands)
    if n == 0 or sum(c.size for c in cands) <= floor:  # every candidate fits under the knee: nothing to choose
        return floor
    f = drafted_values(cands) if values is None else values
    expected = n + np.concatenate(([0.0], np.cumsum(f)))  # E(n + j) = expected[j]

    def rate(j: int) -> float:
        return float(expected[j]) / max(t_spent_s + t_target(n + j), 1e-12)

    # E is concave (f sorted, highest first) and T non-decreasing and convex (flat, then linear), so E/T
    # rises to one peak and falls: a binary search for it needs O(log) cost-model calls, not one per k
    lo, hi = 0, len(f)
    while lo < hi:
        mid = (lo + hi) // 2
        if rate(mid + 1) > rate(mid):
            lo = mid + 1
        else:
            hi = mid
    return max(floor, n + lo)


def slo_budget(cands: Sequence[TokenTree], *, base: np.ndarray, rate: np.ndarray, margin: np.ndarray, depth: int,
               n_max: int, order: str, t_spent_s: float, t_target: Callable[[int], float],
               values: np.ndarray | None = None) -> int:
    """B for this iteration by the SLO rule (module docstring). Per request, A_r(T) = base_r + rate_r * T:
    ``base`` = (l_r / tpot_r - o_r), ``rate`` = 1 / tpot_r (both 0 without an SLO); ``margin``: the SLO
    phase's aim above A(r) (0 without an SLO). ``depth``, ``n_max``, ``order``: the selection's own; ``values``:
    ``drafted_values(cands)`` if already computed."""
    n = len(cands)
    if n == 0:
        return 0
    nodes = RankedNodes.of([strict_log_probs(c) for c in cands])
    total = int(nodes.sizes.sum())
    f = drafted_values(cands) if values is None else values
    expected = n + np.concatenate(([0.0], np.cumsum(f)))  # E(n + j): roots' bonus tokens + the top j nodes
    reach = nodes.reach(n_max)
    grid = np.unique(np.linspace(n, total, SLO_BUDGET_STEPS + 1).round().astype(np.int64))
    best, best_key = n, (-1, -1.0)
    for b in grid:
        t = t_spent_s + t_target(int(b))
        a = base + rate * t  # A_r(T(B))
        req = a + margin
        want = slo_wishes(nodes, req, depth=depth, n_max=n_max)
        got = slo_grants(want, req, budget=int(b), order=order)
        on_slo = int(np.count_nonzero((got >= want) & (a <= reach)))
        key = (on_slo, float(expected[b - n]) / max(t, 1e-12))
        if key > best_key:
            best, best_key = int(b), key
    return best


def token_price(cands: Sequence[TokenTree], *, budget: int, t_spent_s: float,
                t_target: Callable[[int], float], values: np.ndarray | None = None) -> float:
    """What one more verified token costs the batch, in expected tokens: the iteration's expected rate at B,
    E(B) / T(B) (the module docstring's E and T, the top B - n nodes by f), times the seconds one more token
    adds to the forward at B (the cost curve's slope over the next PRICE_STEP tokens). 0 where tokens are
    free (below the knee). A node worth less than this slows the iteration by more than it yields; the SLO
    phase takes none (selection.select_adaserve's ``min_value``). ``values``: ``drafted_values(cands)``."""
    n = len(cands)
    if n == 0:
        return 0.0
    f = drafted_values(cands) if values is None else values
    k = min(max(budget - n, 0), len(f))
    verify = n + k
    t = t_spent_s + t_target(verify)
    slope = max(0.0, t_target(verify + PRICE_STEP) - t_target(verify)) / PRICE_STEP
    return float(n + f[:k].sum()) / max(t, 1e-12) * slope
