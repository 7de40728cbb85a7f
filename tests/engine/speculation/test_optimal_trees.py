"""Algorithm 1 against brute force: every connected subtree of every request, every allocation of B."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from adaserve.engine.model.tree import TokenTree
from adaserve.engine.speculation import optimal_trees as opt
from adaserve.engine.speculation import selection

TOL = 1e-9  # float sums in different orders: brute force brackets the threshold from both sides


@st.composite
def known_tree(draw: st.DrawFn, max_size: int = 6, ties: bool = True) -> TokenTree:
    """Any shape (not only beams): parents[i] < i, f(child) = f(parent) * q with q in (0, 1]."""
    size = draw(st.integers(1, max_size))
    parents, lps = [-1], [0.0]
    for i in range(1, size):
        p = draw(st.integers(0, i - 1))
        q = draw(st.one_of(st.just(1.0), st.floats(0.05, 0.95)) if ties else st.floats(0.05, 0.95))
        parents.append(p)
        lps.append(lps[p] + math.log(q))
    return TokenTree.from_lists(list(range(size)), parents, lps)


@st.composite
def problem(draw: st.DrawFn, ties: bool = True) -> tuple[list[TokenTree], list[float], int]:
    trees = draw(st.lists(known_tree(ties=ties), min_size=1, max_size=3))
    n = len(trees)
    req = draw(st.lists(st.floats(-0.5, 3.5), min_size=n, max_size=n))
    budget = draw(st.integers(0, sum(t.size for t in trees) + 1))
    return trees, req, budget


@st.composite
def tight_problem(draw: st.DrawFn, ties: bool = True) -> tuple[list[TokenTree], list[float], int]:
    """Each A(r) just above the sum of its root and k best nodes, B near the sum of those minima: the
    cases where the SLO step binds (plain random draws are mostly slack or infeasible)."""
    trees = draw(st.lists(known_tree(ties=ties), min_size=2, max_size=3))
    req, need = [], 0
    for t in trees:
        acc = np.cumsum(np.sort(np.exp(t.log_probs))[::-1])  # acc[k]: root + the k best nodes
        k = draw(st.integers(0, t.size - 1))
        frac = draw(st.floats(0.01, 0.99))
        req.append(float(acc[0] - frac) if k == 0 else float(acc[k] - frac * (acc[k] - acc[k - 1])))
        need += k + 1
    return trees, req, need + draw(st.integers(-1, 3))


def connected_subtrees(t: TokenTree) -> list[tuple[int, ...]]:
    """Every node set holding the root and closed under parents (bitmask enumeration)."""
    out = []
    for mask in range(1 << (t.size - 1)):
        nodes = (0, *(i for i in range(1, t.size) if mask >> (i - 1) & 1))
        if all(int(t.parents[v]) in nodes for v in nodes[1:]):
            out.append(nodes)
    return out


def brute_force(trees: list[TokenTree], req: list[float], budget: int, slack: float) -> float | None:
    """Max total f over feasible allocations, a tree meeting A(r) when its sum >= A(r) + slack."""
    best_by_size = []  # per request: size -> best f-sum among feasible connected subtrees of that size
    for t, a in zip(trees, req, strict=True):
        f = np.exp(t.log_probs)
        best: dict[int, float] = {}
        for nodes in connected_subtrees(t):
            s = float(f[list(nodes)].sum())
            if s >= a + slack:
                best[len(nodes)] = max(best.get(len(nodes), -1.0), s)
        best_by_size.append(best)
    top = None
    for sizes in itertools.product(*(b.keys() for b in best_by_size)):
        if sum(sizes) <= budget:
            total = sum(b[k] for b, k in zip(best_by_size, sizes, strict=True))
            top = total if top is None else max(top, total)
    return top


@settings(max_examples=150, deadline=None)
@given(st.one_of(problem(), tight_problem()))
def test_algorithm1_matches_brute_force(p: tuple[list[TokenTree], list[float], int]):
    trees, req, budget = p
    res = opt.optimal_trees(trees, req, budget=budget)
    strict = brute_force(trees, req, budget, slack=TOL)  # feasible with room to spare
    loose = brute_force(trees, req, budget, slack=-TOL)  # feasible up to rounding
    if strict is not None:
        assert res is not None
        assert res.expected_accepted >= strict - TOL
    if loose is None:
        assert res is None
    if res is not None:
        assert loose is not None and res.expected_accepted <= loose + TOL
        assert sum(map(len, res.selected)) <= budget
        for t, s, a in zip(trees, res.selected, req, strict=True):
            assert s[0] == 0 and all(int(t.parents[v]) in s for v in s[1:])
            assert float(np.exp(t.log_probs[s]).sum()) >= a - TOL
        total = sum(float(np.exp(t.log_probs[s]).sum()) for t, s in zip(trees, res.selected, strict=True))
        assert res.expected_accepted == pytest.approx(total)


@settings(max_examples=60, deadline=None)
@given(st.one_of(problem(ties=False), tight_problem(ties=False)))
def test_adaserve_equals_algorithm1_when_candidates_cover_everything(p):
    # With no depth cap, no n_max and every node already drafted, Algorithm 2 is Algorithm 1. (No ties:
    # Algorithm 2 nudges tied path probabilities apart by 1e-6, which may reorder exact ties.)
    trees, req, budget = p
    res = opt.optimal_trees(trees, req, budget=budget)
    if res is None or budget < len(trees):
        return
    sel = selection.select_adaserve(trees, req, budget=budget, depth=10**6, n_max=10**6)
    assert sel == res.selected


def chain(f: list[float]) -> TokenTree:
    return TokenTree.from_lists(list(range(len(f))), list(range(-1, len(f) - 1)), [math.log(x) for x in f])


def test_invalid_cases():
    c = chain([1.0, 0.9, 0.8])
    assert opt.optimal_trees([c, c], [0.0, 0.0], budget=1) is None  # roots do not fit
    assert opt.optimal_trees([c], [3.0], budget=10) is None  # 1 + .9 + .8 < 3: the tree is too small
    assert opt.optimal_trees([c, c], [2.5, 2.5], budget=5) is None  # needs 3 + 3 tokens
    ok = opt.optimal_trees([c, c], [2.5, 2.5], budget=6)
    assert ok is not None and ok.selected == [[0, 1, 2], [0, 1, 2]]
    assert ok.expected_accepted == pytest.approx(5.4)


def test_global_step_prefers_the_other_request():
    a, b = chain([1.0, 0.3, 0.2]), chain([1.0, 0.9, 0.8])
    # a needs 1.3 (one node); the two spare tokens go to b's .9 and .8, not a's .2
    res = opt.optimal_trees([a, b], [1.3, 0.0], budget=5)
    assert res is not None and res.selected == [[0, 1], [0, 1, 2]]


def test_rejects_increasing_path_probability():
    bad = TokenTree.from_lists([0, 1, 2], [-1, 0, 1], [0.0, math.log(0.5), math.log(0.6)])
    with pytest.raises(ValueError):
        opt.optimal_trees([bad], [1.0], budget=3)
    with pytest.raises(ValueError):
        opt.optimal_trees([bad], [1.0, 2.0], budget=3)
