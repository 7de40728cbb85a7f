"""Algorithm 1: the optimal draft trees when every path probability f(v) is known (AdaServe section 4.1).

The yardstick, not a serving path: no policy calls it (docs/architecture.md §5). It is what
Algorithm 2 (selection.select_adaserve) is measured against. tests/engine/speculation/test_optimal_trees.py proves
it optimal by brute force and shows Algorithm 2 equals it when nothing caps the selection; the benchmark
(bench/selection_gap.py) runs it on each iteration's real candidate trees to report how far the engine's
choice was from the optimum.
T_inf(r) is infinite; here each request's stand-in is an explicit finite ``TokenTree`` whose
``log_probs`` are the known log f(v).

Problem (Eq. 1, 5, 6): choose connected trees T_i, each holding its root, to
    maximise  sum_i sum_{v in T_i} f(v)
    s.t.      sum_i |T_i| <= B            (roots count, as in Algorithm 2 and Eq. 1)
              sum_{v in T_i} f(v) >= A(r_i)   (root counts f = 1).
Algorithm 1: per request, add its highest-f nodes until its A(r_i) is met (the fewest nodes that can
meet it, Lemma C.1); then spend the rest of B on the globally highest-f nodes (Lemma C.2). Each per-tree
prefix sum of sorted f is concave in the node count, so this marginal greedy is optimal (Appendix C).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from adaserve.engine.model.tree import TokenTree


@dataclass(frozen=True)
class OptimalTrees:
    """Algorithm 1's answer: per request the sorted node indices kept, and the objective sum f(v)."""

    selected: list[list[int]]
    expected_accepted: float  # E[sum_i acc(T_i)] = sum over all kept nodes of f(v), roots included


def optimal_trees(trees: Sequence[TokenTree], requirements: Sequence[float], *,
                  budget: int) -> OptimalTrees | None:
    """Algorithm 1 on explicit trees. Returns None (INVALID) when no allocation of ``budget`` tokens
    meets every A(r): the roots do not fit, the fewest nodes meeting every A(r) exceed B, or a finite
    tree holds too little probability mass to meet its A(r) at all.

    Requires f(child) <= f(parent) (true of path probabilities); ties are broken by node index, which
    ranks parents first, so every greedy prefix is a connected tree (Appendix B).
    """
    req = np.asarray(requirements, np.float64).reshape(-1)
    if len(req) != len(trees):
        raise ValueError(f"{len(trees)} trees but {len(req)} requirements")
    if np.any(np.isnan(req)):
        raise ValueError("NaN SLO requirement")
    for t in trees:
        if t.size > 1 and np.any(t.log_probs[1:] > t.log_probs[t.parents[1:]]):
            raise ValueError("a child's path probability exceeds its parent's: not path probabilities")

    # order[i]: request i's non-root nodes by descending f, ties by index (parents first)
    order = [np.lexsort((np.arange(1, t.size), -t.log_probs[1:])) + 1 for t in trees]
    f = [np.exp(t.log_probs) for t in trees]

    # Step 1: the fewest nodes meeting A(r_i); n_acc starts at 1.0 for the root (Lemma C.1).
    left = budget - len(trees)
    taken = []
    for i in range(len(trees)):
        n_acc = np.cumsum(np.concatenate(([1.0], f[i][order[i]])))  # n_acc after k nodes, k = 0..M-1
        k = int(np.searchsorted(n_acc, req[i], side="left"))
        if k >= len(n_acc):  # even the whole tree falls short of A(r_i)
            return None
        taken.append(k)
        left -= k
    if left < 0:
        return None

    # Step 2: the rest of B on the globally highest-f remaining nodes (Lemma C.2).
    cand = [(-trees[i].log_probs[v], i, int(v)) for i in range(len(trees)) for v in order[i][taken[i]:]]
    for _, i, _ in sorted(cand)[:left]:  # within a request this extends its prefix in order[i]
        taken[i] += 1

    selected = [sorted([0, *(int(v) for v in order[i][: taken[i]])]) for i in range(len(trees))]
    total = float(sum(f[i][s].sum() for i, s in enumerate(selected)))
    return OptimalTrees(selected=selected, expected_accepted=total)
