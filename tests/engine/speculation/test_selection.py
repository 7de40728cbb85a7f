"""Selection policies: Figure 5, and properties over random beam-search candidate trees."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from adaserve.engine.model.tree import TokenTree
from adaserve.engine.speculation import selection

FAST = settings(max_examples=60, deadline=None)


# ---- builders -----------------------------------------------------------------------------------------
def tree(parents: list[int], f: list[float]) -> TokenTree:
    """A candidate tree from parents and path probabilities f (root f = 1)."""
    return TokenTree.from_lists(list(range(len(parents))), parents, [math.log(x) for x in f])


@st.composite
def beam_tree(draw: st.DrawFn, max_depth: int = 4, max_width: int = 3) -> TokenTree:
    """Like the draft's beam search: w nodes per level, each under a node of the level above, with
    f(child) = f(parent) * q. q = 1 (a draft probability of exactly 1) makes parent/child ties."""
    depth = draw(st.integers(0, max_depth))
    width = draw(st.integers(1, max_width))
    parents, lps, prev = [-1], [0.0], [0]
    for _ in range(depth):
        layer = []
        for _ in range(width):
            p = draw(st.sampled_from(prev))
            q = draw(st.one_of(st.sampled_from([1.0, 0.5, 0.25]), st.floats(0.01, 0.99)))
            parents.append(p)
            lps.append(lps[p] + math.log(q))
            layer.append(len(parents) - 1)
        prev = layer
    return TokenTree.from_lists(list(range(len(parents))), parents, lps)


@st.composite
def batch(draw: st.DrawFn) -> dict:
    cands = draw(st.lists(beam_tree(), min_size=1, max_size=4))
    n, total = len(cands), sum(c.size for c in cands)
    return {
        "cands": cands,
        "requirements": draw(st.lists(st.floats(-1.0, 6.0), min_size=n, max_size=n)),
        "budget": draw(st.integers(n, total + 2)),
        "depth": draw(st.integers(0, 5)),
        "n_max": draw(st.integers(1, 8)),
    }


def slo_phase(cands: list[TokenTree], requirements: list[float], *, budget: int, depth: int,
              n_max: int) -> list[list[int]]:
    """Algorithm 2's first phase alone: the step select_adaserve runs before spending the rest of B.
    Private in the engine (nothing serves with it alone), so reached here through the module."""
    req = selection._validated(cands, requirements, budget=budget, depth=depth, n_max=n_max)
    lps = [selection.strict_log_probs(c) for c in cands]
    return selection._as_lists(selection._slo_phase(lps, req, budget=budget, depth=depth, n_max=n_max))


def strict_lp(c: TokenTree) -> np.ndarray:
    """The f the selection ranks by: ties nudged only where the decrease is not strict."""
    lp = c.log_probs
    return lp if c.size == 1 or np.all(lp[1:] < lp[c.parents[1:]]) else c.with_strict_decrease().log_probs


def assert_trees(cands: list[TokenTree], sel: list[list[int]]) -> None:
    """Every selection is sorted, unique, holds its root, is closed under parents."""
    assert len(sel) == len(cands)
    for c, s in zip(cands, sel, strict=True):
        assert s == sorted(set(s)) and s[0] == 0
        assert all(0 <= v < c.size for v in s)
        assert all(int(c.parents[v]) in s for v in s[1:])
        assert c.subtree(s).size == len(s)  # raises if disconnected


# ---- Figure 5 -----------------------------------------------------------------------------------------
# Two candidate trees, d = 3, w = 2, nodes t0 (root) .. t6 in level order. f strictly decreases along paths
# and each level holds the top-2 of plausible beam expansions.
#   r0: t1 .7, t2 .2 | t3 .49 (t1), t4 .14 (t1) | t5 .392 (t3), t6 .07 (t4)
#   r1: t1 .5, t2 .4 | t3 .35 (t1), t4 .24 (t2) | t5 .21 (t3),  t6 .12 (t4)
FIG5 = [
    tree([-1, 0, 0, 1, 1, 3, 4], [1.0, 0.7, 0.2, 0.49, 0.14, 0.392, 0.07]),
    tree([-1, 0, 0, 1, 2, 3, 4], [1.0, 0.5, 0.4, 0.35, 0.24, 0.21, 0.12]),
]


def test_figure5_worked_example():
    # The caption's A_cap 0.6 / 0.8 count tokens beyond the bonus; A(r) counts the bonus (root f = 1).
    req = [1.0 + 0.6, 1.0 + 0.8]
    slo = slo_phase(FIG5, req, budget=8, depth=3, n_max=8)
    assert slo == [[0, 1], [0, 1, 2]]  # r0: t1 (1.7 >= 1.6); r1: t1, t2 (1.5 < 1.8 <= 1.9)
    final = selection.select_adaserve(FIG5, req, budget=8, depth=3, n_max=8)
    # remaining budget 8 - 2 roots - 3 = 3 -> t3(0) .49, t5(0) .392, t3(1) .35
    assert final == [[0, 1, 3, 5], [0, 1, 2, 3]]
    assert sum(map(len, final)) == 8
    assert_trees(FIG5, final)


def test_figure5_literal_caption_values_are_met_by_roots():
    # Read literally under Algorithm 2 (n_acc starts at 1.0), 0.6 and 0.8 are met by the roots alone:
    # why the caption's numbers must be A(r) - 1.
    slo = slo_phase(FIG5, [0.6, 0.8], budget=8, depth=3, n_max=8)
    assert slo == [[0], [0]]


# ---- select_adaserve properties -----------------------------------------------------------------------
@FAST
@given(batch())
def test_adaserve_budget_connectivity_and_phases(b: dict):
    cands, req = b["cands"], b["requirements"]
    kw = {"budget": b["budget"], "depth": b["depth"], "n_max": b["n_max"]}
    slo = slo_phase(cands, req, **kw)
    final = selection.select_adaserve(cands, req, **kw)
    assert_trees(cands, slo)
    assert_trees(cands, final)

    # budget: never exceeded, and spent whenever there are nodes to spend it on
    total = sum(c.size for c in cands)
    assert sum(map(len, final)) == min(b["budget"], total)
    assert sum(map(len, slo)) <= b["budget"]

    lps = [strict_lp(c) for c in cands]
    for c, lp, s, fin in zip(cands, lps, slo, final, strict=True):
        assert set(s) <= set(fin)
        assert len(s) <= max(1, b["n_max"])  # n_max caps the SLO phase
        # the SLO phase takes the request's own top-|s| nodes by f
        rest = [v for v in range(1, c.size) if v not in s]
        if len(s) > 1 and rest:
            assert lp[s[1:]].min() >= lp[rest].max()

    # throughput phase: its picks rank above every node left out, across all requests
    picked = [lp[v] for lp, s, fin in zip(lps, slo, final, strict=True) for v in set(fin) - set(s)]
    left_out = [lp[v] for c, lp, fin in zip(cands, lps, final, strict=True)
                for v in range(c.size) if v not in fin]
    if picked and left_out:
        assert min(picked) >= max(left_out)


@FAST
@given(batch())
def test_adaserve_serves_larger_requirement_first(b: dict):
    cands, req, d, n_max = b["cands"], b["requirements"], b["depth"], b["n_max"]
    slo = slo_phase(cands, req, budget=b["budget"], depth=d, n_max=n_max)
    tol = 1e-9
    for j, (c, s) in enumerate(zip(cands, slo, strict=True)):
        a_cap = min(req[j], d + 1)
        n_acc = float(np.exp(strict_lp(c)[s]).sum())
        if len(s) > 1:  # minimal: without its last (lowest-f) node the request fell short
            assert n_acc - float(np.exp(strict_lp(c)[s]).min()) < a_cap + tol
        done = n_acc >= a_cap - tol or len(s) >= n_max or len(s) == c.size
        if not done:
            # j stopped for lack of budget: nothing left for anyone with a smaller A(r)
            assert sum(map(len, slo)) == b["budget"]
            for i, si in enumerate(slo):
                if req[i] < req[j]:
                    assert si == [0]


def test_adaserve_scarce_budget_prefers_larger_requirement():
    chain = tree([-1, 0, 1, 2], [1.0, 0.9, 0.8, 0.7])
    # budget 4 = 2 roots + 2: the request needing more takes both spare tokens
    assert selection.select_adaserve([chain, chain], [1.5, 3.0], budget=4, depth=3, n_max=8) == [
        [0], [0, 1, 2]]
    assert selection.select_adaserve([chain, chain], [3.0, 1.5], budget=4, depth=3, n_max=8) == [
        [0, 1, 2], [0]]


def test_adaserve_caps_requirement_at_depth_and_n_max():
    chain = tree([-1, 0, 1, 2, 3, 4], [1.0, 0.9, 0.8, 0.7, 0.6, 0.5])
    # A = 100 is capped at d+1: d = 1 -> 2 (1.9 < 2 <= 2.7), d = 2 -> 3 (2.7 < 3 <= 3.4)
    assert slo_phase([chain], [100.0], budget=10, depth=1, n_max=8) == [[0, 1, 2]]
    assert slo_phase([chain], [100.0], budget=10, depth=2, n_max=8) == [[0, 1, 2, 3]]
    assert slo_phase([chain], [100.0], budget=10, depth=5, n_max=2) == [[0, 1]]


def test_ties_do_not_orphan_nodes():
    # q = 1 twice: parent, child and grandchild share f; a sibling elsewhere ties too
    t = tree([-1, 0, 1, 2, 0], [1.0, 0.5, 0.5, 0.5, 0.5])
    for budget in range(1, 6):
        sel = selection.select_adaserve([t], [0.0], budget=budget, depth=3, n_max=8)
        assert_trees([t], sel)
        assert len(sel[0]) == budget


def test_adaserve_rejects_bad_arguments():
    t = FIG5[0]
    with pytest.raises(ValueError):
        selection.select_adaserve([t, t], [1.0, 1.0], budget=1, depth=3, n_max=4)
    with pytest.raises(ValueError):
        selection.select_adaserve([t], [1.0, 1.0], budget=4, depth=3, n_max=4)
    with pytest.raises(ValueError):
        selection.select_adaserve([t], [float("nan")], budget=4, depth=3, n_max=4)
    with pytest.raises(ValueError):
        selection.select_adaserve([t], [1.0], budget=4, depth=3, n_max=0)
    assert selection.select_adaserve([], [], budget=4, depth=3, n_max=4) == []


def test_slo_requirement():
    # 1.0 s in, 0.05 s iteration, 50 ms TPOT: 21 tokens due; 18 emitted -> 3 owed this iteration
    a = selection.slo_requirement(elapsed_s=1.0, tokens_so_far=18, t_iter_s=0.05, tpot_slo_s=0.05)
    assert a == pytest.approx(3.0)
    assert selection.slo_requirement(elapsed_s=0.0, tokens_so_far=5, t_iter_s=0.01, tpot_slo_s=0.1) < 0
    with pytest.raises(ValueError):
        selection.slo_requirement(elapsed_s=1.0, tokens_so_far=1, t_iter_s=0.05, tpot_slo_s=0.0)
    with pytest.raises(ValueError):
        selection.slo_requirement(elapsed_s=-1.0, tokens_so_far=1, t_iter_s=0.05, tpot_slo_s=0.1)


# ---- baselines ----------------------------------------------------------------------------------------
@FAST
@given(st.lists(beam_tree(), min_size=1, max_size=4), st.integers(0, 30))
def test_global_greedy_is_adaserve_without_slo_phase(cands: list[TokenTree], extra: int):
    budget = len(cands) + extra
    sel = selection.select_global_greedy(cands, budget=budget)
    assert_trees(cands, sel)
    assert sum(map(len, sel)) == min(budget, sum(c.size for c in cands))
    # requirements <= 1 are met by the roots, so Algorithm 2 reduces to its global phase
    zero = [0.0] * len(cands)
    assert sel == selection.select_adaserve(cands, zero, budget=budget, depth=4, n_max=8)


@FAST
@given(st.lists(beam_tree(), min_size=1, max_size=4), st.integers(0, 30))
def test_equal_greedy_splits_budget(cands: list[TokenTree], extra: int):
    n, budget = len(cands), len(cands) + extra
    sel = selection.select_equal_greedy(cands, budget=budget)
    assert_trees(cands, sel)
    assert sum(map(len, sel)) <= budget
    for i, (c, s) in enumerate(zip(cands, sel, strict=True)):
        share = budget // n + (1 if i < budget % n else 0)
        assert len(s) == min(share, c.size)
        lp = strict_lp(c)
        rest = [v for v in range(c.size) if v not in s]
        if rest:
            assert lp[s].min() >= lp[rest].max()


def test_the_slo_phase_order_decides_who_a_binding_budget_serves() -> None:
    """Two requests whose trees both fit the budget alone but not together: "largest-need" (the paper's
    text) serves the one furthest behind first, "smallest-need" (the artifact's scheduler) the nearer one."""
    a = tree([-1, 0, 1, 2], [1.0, 0.9, 0.8, 0.7])
    b = tree([-1, 0, 1, 2], [1.0, 0.9, 0.8, 0.7])
    needs = [1.9, 3.5]  # a needs one drafted node, b all three
    largest = selection.select_adaserve([a, b], needs, budget=2 + 3, depth=3, n_max=16, order="largest-need")
    smallest = selection.select_adaserve([a, b], needs, budget=2 + 3, depth=3, n_max=16, order="smallest-need")
    assert largest == [[0], [0, 1, 2, 3]]  # b takes the whole budget
    assert smallest == [[0, 1], [0, 1, 2]]  # a is served, b gets what is left
    with pytest.raises(ValueError, match="SLO order"):
        selection.select_adaserve([a], [1.0], budget=4, depth=3, n_max=16, order="random")


def reference_throughput_phase(lps: list[np.ndarray], chosen: list[np.ndarray], *, budget: int) -> list[np.ndarray]:
    """The throughput phase as first written: a mask cleared request by request, then a scan per request."""
    left = budget - sum(len(c) for c in chosen)
    if left <= 0 or not chosen:
        return list(chosen)
    m = max(len(lp) for lp in lps)
    lp = np.full((len(lps), m), -np.inf)
    for i, row in enumerate(lps):
        lp[i, : len(row)] = row
    free = np.isfinite(lp)
    for i, c in enumerate(chosen):
        free[i, c] = False
    flat = np.flatnonzero(free)
    top = flat[np.argsort(-lp.reshape(-1)[flat], kind="stable")[:left]]
    req_of, node_of = np.divmod(top, m)
    return [np.concatenate((c, node_of[req_of == i])) for i, c in enumerate(chosen)]


@given(batch())
def test_throughput_phase_picks_exactly_what_the_scan_per_request_picked(b: dict):
    """Issue 30 vectorised the phase's bookkeeping: the same nodes, in the same order, per request."""
    cands = b["cands"]
    lps = [np.round(strict_lp(c), 1) for c in cands]  # rounded: ties across requests
    slo = selection._slo_phase(lps, np.asarray(b["requirements"], np.float64), budget=b["budget"],
                               depth=b["depth"], n_max=b["n_max"])
    for budget in (b["budget"], b["budget"] + 3, len(cands)):
        got = selection._throughput_phase(lps, slo, budget=budget)
        want = reference_throughput_phase(lps, slo, budget=budget)
        assert [g.tolist() for g in got] == [w.tolist() for w in want]
        assert selection._as_lists(got) == [sorted(int(i) for i in w) for w in want]


def test_the_value_floor_stops_a_request_pouring_a_tree_it_cannot_fill_into_verification() -> None:
    """A request whose A(r) is beyond its whole tree (a tight TPOT, a margin) takes every node in the SLO
    phase under Algorithm 2, worthless siblings included; with a floor it takes only the nodes worth it,
    and the rest of the budget goes by value across requests (Figure 11 at 0.8x, docs/benchmarks.md)."""
    # a sure chain 0-1-2-3 with an unlikely sibling under each of its nodes (4, 5, 6)
    sure = tree([-1, 0, 1, 2, 0, 1, 2], [1.0, 0.95, 0.9, 0.85, 0.02, 0.015, 0.01])
    other = tree([-1, 0, 1], [1.0, 0.6, 0.4])  # a request with slack, whose nodes are worth more than the siblings
    needs = [6.0, 0.0]  # more than the sure tree's 1 + 0.95 + 0.9 + 0.85 + 0.045 = 3.75 tokens: unreachable
    kw = {"budget": 2 + 5, "depth": 3, "n_max": 16}
    assert slo_phase([sure, other], needs, **kw) == [[0, 1, 2, 3, 4, 5], [0]]  # Algorithm 2: the tree, until B is gone
    assert selection.select_adaserve([sure, other], needs, **kw) == [[0, 1, 2, 3, 4, 5], [0]]
    floored = selection.select_adaserve([sure, other], needs, **kw, min_value=0.1)
    assert floored == [[0, 1, 2, 3], [0]]  # the chain; the two siblings leave the iteration, not handed on
    slo = selection._slo_phase([strict_lp(sure), strict_lp(other)], np.asarray(needs), budget=7, depth=3, n_max=16,
                               min_value=0.1)
    assert [sorted(s.tolist()) for s in slo] == [[0, 1, 2, 3], [0]]
    # a reachable target is met as before from nodes worth more than the floor
    assert selection.select_adaserve([sure], [2.5], budget=4, depth=3, n_max=16, min_value=0.1) == [[0, 1, 2, 3]]
    # left out only where the budget binds: with room beyond what the SLO phase took without the floor
    # (6 of 7 nodes at B = 10), the throughput phase still verifies them
    assert selection.select_adaserve([sure], [6.0], budget=7, depth=3, n_max=16, min_value=0.1) == [[0, 1, 2, 3]]
    assert selection.select_adaserve([sure], [6.0], budget=10, depth=3, n_max=16, min_value=0.1) == [
        [0, 1, 2, 3, 4, 5, 6]]
    with pytest.raises(ValueError, match="min_value"):
        selection.select_adaserve([sure], [1.0], budget=4, depth=3, n_max=16, min_value=-1.0)


@given(batch(), st.floats(0.0, 1.0))
def test_a_floor_only_ever_shrinks_the_slo_phase(b: dict, floor: float):
    cands, req = b["cands"], np.asarray(b["requirements"], np.float64)
    lps = [strict_lp(c) for c in cands]
    kw = {"budget": b["budget"], "depth": b["depth"], "n_max": b["n_max"]}
    nodes = selection.RankedNodes.of(lps)
    wish = {"depth": b["depth"], "n_max": b["n_max"]}
    assert np.all(selection.slo_wishes(nodes, req, **wish, min_value=floor) <= selection.slo_wishes(nodes, req, **wish))
    plain = selection._slo_phase(lps, req, **kw)
    floored = selection._slo_phase(lps, req, **kw, min_value=floor)
    assert sum(map(len, floored)) <= sum(map(len, plain))  # a request further on may get more of a binding B
    for f, lp in zip(floored, lps, strict=True):
        assert all(np.exp(lp[v]) >= floor for v in f.tolist() if v != 0)
    final = selection.select_adaserve(cands, list(req), **kw, min_value=floor)
    assert_trees(cands, final)
    assert sum(map(len, final)) <= b["budget"]
    for f, fin in zip(floored, final, strict=True):
        assert set(f.tolist()) <= set(fin)
    # what the floor keeps out leaves the iteration: never more verified than without the floor
    assert sum(map(len, final)) <= sum(map(len, selection.select_adaserve(cands, list(req), **kw)))


@given(batch(), st.sampled_from([0.0, 0.001, 0.05, 0.3]), st.sampled_from(selection.SLO_ORDERS))
def test_the_whole_trees_shortcut_is_what_both_phases_choose(b: dict, floor: float, order: str):
    """select_adaserve skips both phases when every node fits the budget and passes the floor: the same nodes
    as the phases pick, whichever way the batch falls (budgets reach past the trees' total here)."""
    kw = {"budget": b["budget"], "depth": b["depth"], "n_max": b["n_max"], "order": order, "min_value": floor}
    _, phases = selection.adaserve_phases(b["cands"], b["requirements"], **kw)
    assert selection.select_adaserve(b["cands"], b["requirements"], **kw) == [np.sort(t).tolist() for t in phases]


def test_whole_trees_are_kept_only_when_every_node_fits_and_pays() -> None:
    chain = tree([-1, 0, 1], [1.0, 0.5, 0.02])
    assert selection.select_adaserve([chain], [1.0], budget=3, depth=2, n_max=16) == [[0, 1, 2]]
    # a node below the floor, which the SLO phase wants: it stops short of it, and the throughput phase gets
    # nothing for it
    assert selection.select_adaserve([chain], [3.0], budget=3, depth=2, n_max=16, min_value=0.1) == [[0, 1]]
    # one slot short of the whole tree
    assert selection.select_adaserve([chain], [1.0], budget=2, depth=2, n_max=16) == [[0, 1]]



def _random_beam(rng: np.random.Generator) -> TokenTree:
    """A beam search's tree of random depth, width and conditional probabilities."""
    parents, lps, prev = [-1], [0.0], [0]
    for _ in range(int(rng.integers(1, 5))):
        layer = []
        for p in rng.choice(prev, size=int(rng.integers(1, 4))).tolist():
            parents.append(p)
            lps.append(lps[p] + math.log(float(rng.uniform(0.01, 0.99))))
            layer.append(len(parents) - 1)
        prev = layer
    return TokenTree.from_lists(list(range(len(parents))), parents, lps)


def test_a_lone_request_takes_the_phases_nodes() -> None:
    """One request: select_adaserve's shortcut (selection._lone_request) keeps exactly the nodes Algorithm 2's two
    phases keep, over 3,000 random trees, requirements, budgets, depths, caps and floors (a seeded sweep: the
    floor's cut changes the phases' result in about a tenth of them, which a property test's draws rarely reach)."""
    rng = np.random.default_rng(0)
    floored = 0
    for _ in range(3000):
        cand = _random_beam(rng)
        req = float(rng.uniform(-1.0, 8.0))
        kw = {"budget": int(rng.integers(1, 20)), "depth": int(rng.integers(0, 6)), "n_max": int(rng.integers(1, 9)),
              "min_value": float(rng.choice([0.0, rng.uniform(0.0, 1.0)]))}
        lp = selection.strict_log_probs(cand)
        _, phases = selection._phases([lp], np.array([req]), order="smallest-need", **kw)
        want = selection._as_lists(phases)
        assert selection._lone_request(lp, req, **kw) == want[0]
        assert selection.select_adaserve([cand], [req], **kw) == want
        floored += selection._slo_phase_and_cut([lp], np.array([req]), budget=kw["budget"], depth=kw["depth"],
                                                n_max=kw["n_max"], order="smallest-need",
                                                min_value=kw["min_value"])[1] > 0
    assert floored > 100  # the floor's cut was exercised
