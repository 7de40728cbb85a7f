"""The bench's yardstick: the engine's selection against Algorithm 1 on the same candidate trees."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from adaserve.bench.selection_gap import SelectionGap, budgeted, measure
from adaserve.engine.model.tree import TokenTree
from adaserve.engine.request import Request
from adaserve.engine.speculation import selection
from adaserve.engine.speculation.policies import SelectionContext, SelectionRecord
from adaserve.engine.speculation.sampling import SamplingParams
from tests.engine.helpers import engine


def chain(f: list[float]) -> TokenTree:
    return TokenTree.from_lists(list(range(len(f))), list(range(-1, len(f) - 1)), [math.log(x) for x in f])


def record(cands: list[TokenTree], needs: list[float], selected: list[list[int]], *, budget: int,
           depth: int = 3) -> SelectionRecord:
    return SelectionRecord(cands, needs, selected, SelectionContext(budget=budget, depth=depth, now_s=0.0,
                                                                    t_iter_s=0.0))


A, B = chain([1.0, 0.3, 0.2]), chain([1.0, 0.9, 0.8])


def test_algorithm2_reaches_the_optimum():
    # a needs 1.3 (its one node); the two spare tokens go to b's .9 and .8
    needs = [1.3, 0.0]
    sel = selection.select_adaserve([A, B], needs, budget=5, depth=3, n_max=8)
    row = measure(record([A, B], needs, sel, budget=5))
    assert row.optimum == pytest.approx(1.3 + 2.7)
    assert row.expected == pytest.approx(row.optimum) and row.met == 2 and row.optimal


def test_global_greedy_beats_the_optimum_only_by_missing_a_target():
    needs = [1.3, 0.0]
    sel = selection.select_global_greedy([A, B], budget=4)  # b's .9 and .8: a gets nothing
    row = measure(record([A, B], needs, sel, budget=4))
    assert row.optimum == pytest.approx(1.3 + 1.9)  # a's .3 and b's .9
    assert row.expected == pytest.approx(1.0 + 2.7) and row.expected > row.optimum
    assert row.met == 1 and not row.optimal
    assert row.ceiling == pytest.approx(row.expected)


def test_equal_greedy_leaves_expected_tokens_behind():
    needs = [0.0, 0.0]
    sel = selection.select_equal_greedy([A, B], budget=4)  # two nodes each, whatever they are worth
    row = measure(record([A, B], needs, sel, budget=4))
    assert row.optimum == pytest.approx(1.0 + 2.7)
    assert row.optimum - row.expected == pytest.approx(0.8 - 0.3)
    assert not row.optimal


def test_unreachable_target_asks_for_the_whole_tree_and_scarce_budget_is_infeasible():
    # A(r) = 10 is capped at d + 1 = 4, then at the tree's own mass 2.7: the whole of b
    row = measure(record([A, B], [0.0, 10.0], [[0], [0, 1, 2]], budget=4))
    assert row.optimum == pytest.approx(1.0 + 2.7) and row.met == 2 and row.optimal
    row = measure(record([A, B], [1.5, 10.0], [[0, 1], [0, 1]], budget=4))  # needs 2 + 3 > 4 tokens
    assert row.optimum is None and not row.optimal


def test_which_policies_are_measured():
    assert budgeted("adaserve") and budgeted("global-greedy") and budgeted("beam:3,2")
    assert not budgeted("chain:4") and not budgeted("specinfer") and not budgeted("incremental")


@pytest.mark.parametrize("policy", ["adaserve", "global-greedy"])
def test_engine_records_every_speculative_iteration(policy: str, target_dir: Path) -> None:
    eng = engine(target_dir, target_dir, policy, budget=10)
    gap = SelectionGap()
    eng.selection_listeners.append(gap.observe)
    for i, slo in enumerate([0.5, 0.5, 10_000.0, None]):
        eng.add_request(Request(f"r{i}", [7, 8, 9 + i], SamplingParams(max_tokens=16, ignore_eos=True),
                                tpot_slo_ms=slo))
    while eng.has_work:
        eng.step()
    summary = gap.summary()
    assert summary["iterations"] == sum(1 for m in eng.history if m.depth > 0) > 0
    assert summary["feasible_iterations"] > 0
    if policy == "adaserve":  # Algorithm 2 is Algorithm 1 whenever the optimum exists (n_max never binds here)
        assert summary["optimal_share"] == 1.0
        assert summary["mean_gap_tokens"] == pytest.approx(0.0, abs=1e-6)
    assert 0.0 < summary["share_of_ceiling"] <= 1.0 + 1e-9
    assert len(gap.trace()) == summary["iterations"]
