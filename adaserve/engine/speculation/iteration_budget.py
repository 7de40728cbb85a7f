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
Pure: numpy and a cost callback.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from adaserve.engine.model.tree import TokenTree


def goodput_budget(cands: Sequence[TokenTree], *, floor: int, t_spent_s: float,
                   t_target: Callable[[int], float]) -> int:
    """B for this iteration (see the module docstring); ``t_target(k)``: seconds to verify k tokens."""
    n = len(cands)
    if n == 0:
        return floor
    f = np.sort(np.concatenate([np.exp(c.log_probs[1:]) for c in cands]))[::-1]
    if n + len(f) <= floor:  # every candidate fits under the knee: nothing to choose
        return floor
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
