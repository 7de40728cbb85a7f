"""The per-iteration budget: the knee is a floor, more tokens are verified only when they pay."""

from __future__ import annotations

import numpy as np

from adaserve.engine.model.tree import TokenTree
from adaserve.engine.speculation.iteration_budget import drafted_values, goodput_budget, slo_budget, token_price


def chain(probs: list[float]) -> TokenTree:
    """A chain whose node i has path probability probs[i-1] (the root has 1)."""
    n = len(probs) + 1
    lp = np.log(np.array([1.0, *probs]))
    return TokenTree(np.arange(n, dtype=np.int64), np.arange(-1, n - 1, dtype=np.int64), lp)


def test_never_below_the_floor() -> None:
    cands = [chain([0.1, 0.01])] * 4
    steep = lambda k: 0.01 * k  # noqa: E731 - every token costs as much as the whole forward
    assert goodput_budget(cands, floor=6, t_spent_s=0.0, t_target=steep) == 6


def test_verifies_every_candidate_when_tokens_are_nearly_free() -> None:
    cands = [chain([0.9, 0.8, 0.7, 0.6])] * 8  # 40 nodes in all
    flat = lambda k: 0.02 + 1e-6 * k  # noqa: E731
    assert goodput_budget(cands, floor=16, t_spent_s=0.005, t_target=flat) == 40


def test_stops_where_the_next_token_is_worth_less_than_it_costs() -> None:
    # 8 requests, path probabilities 0.9 then 0.05: the likely nodes pay for themselves, the unlikely not
    cands = [chain([0.9, 0.05])] * 8
    linear = lambda k: 0.01 + 0.001 * k  # noqa: E731 - a token costs 10% of the fixed part
    # E/T at k = 8 (roots): 8/0.018 = 444; k = 16: 15.2/0.026 = 585; k = 24: 15.6/0.034 = 459
    assert goodput_budget(cands, floor=4, t_spent_s=0.0, t_target=linear) == 16


def test_everything_under_the_floor_needs_no_choice() -> None:
    cands = [chain([0.5])] * 3
    assert goodput_budget(cands, floor=64, t_spent_s=0.0, t_target=lambda k: 1.0) == 64
    assert goodput_budget([], floor=8, t_spent_s=0.0, t_target=lambda k: 1.0) == 8


def test_the_search_finds_the_same_peak_as_trying_every_k() -> None:
    rng = np.random.default_rng(7)
    for trial in range(50):
        cands = [chain(list(np.cumprod(rng.uniform(0.05, 0.99, size=int(rng.integers(1, 9))))))
                 for _ in range(int(rng.integers(1, 30)))]
        knee, slope, spent = int(rng.integers(1, 64)), float(rng.uniform(1e-5, 1e-3)), float(rng.uniform(0, 0.02))

        def t_target(k: int, knee: int = knee, slope: float = slope) -> float:
            return 0.02 + slope * max(0, k - knee)  # a roofline: flat to the knee, then linear

        n = len(cands)
        f = np.sort(np.concatenate([np.exp(c.log_probs[1:]) for c in cands]))[::-1]
        expected = n + np.concatenate(([0.0], np.cumsum(f)))
        rate = expected / np.array([spent + t_target(n + j) for j in range(len(f) + 1)])
        brute = max(n, n + int(np.argmax(rate)))
        got = goodput_budget(cands, floor=n, t_spent_s=spent, t_target=t_target)
        assert rate[got - n] == rate[brute - n], trial  # the same peak (ties may pick another k)


# ---- the SLO rule ----------------------------------------------------------------------------------------
def _slo(cands: list[TokenTree], base: list[float], tpot_s: list[float], cost, margin: float = 0.0) -> int:
    rate = 1.0 / np.array(tpot_s)
    return slo_budget(cands, base=np.array(base), rate=rate, margin=np.full(len(cands), margin), depth=4, n_max=16,
                      order="smallest-need", t_spent_s=0.0, t_target=cost)


def test_slo_rule_stops_before_a_longer_iteration_pushes_a_request_off_its_target() -> None:
    # one urgent request (36 ms TPOT, A(T) = 1 + T / 0.036) among seven with slack; every candidate node is
    # likely, so the goodput rule verifies all 40, and the 0.19 s iteration needs 6.3 tokens of the urgent
    # request, more than its whole tree holds (1 + 0.95 + 0.9 + 0.85 + 0.8 = 4.5)
    cands = [chain([0.95, 0.9, 0.85, 0.8])] * 8
    cost = lambda k: 0.03 + 0.004 * k  # noqa: E731
    base, tpot = [1.0] + [-50.0] * 7, [0.036] + [0.15] * 7
    reach = 4.5
    g = goodput_budget(cands, floor=8, t_spent_s=0.0, t_target=cost)
    assert g == 40 and 1 + cost(g) / 0.036 > reach
    b = _slo(cands, base, tpot, cost)
    assert 1 + cost(b) / 0.036 <= reach + 1e-9  # the urgent request can still be on target
    assert 8 < b < 40  # and it verifies more than the roots where that costs nobody their target


def test_slo_rule_is_the_goodput_peak_when_everyone_has_slack() -> None:
    cands = [chain([0.9, 0.05])] * 8
    linear = lambda k: 0.01 + 0.001 * k  # noqa: E731
    b = _slo(cands, [-100.0] * 8, [0.05] * 8, linear)
    assert b == 16  # test_stops_where_the_next_token_is_worth_less_than_it_costs: the E/T peak, on the grid


def test_slo_rule_is_not_pulled_up_by_a_hopeless_request() -> None:
    # one request 50 tokens behind: no tree saves it this iteration, so it does not buy a longer iteration
    cands = [chain([0.95, 0.9, 0.85, 0.8])] * 8
    cost = lambda k: 0.03 + 0.004 * k  # noqa: E731
    with_hopeless = _slo(cands, [50.0, 1.0] + [-50.0] * 6, [0.036] * 2 + [0.15] * 6, cost)
    without = _slo(cands, [-50.0, 1.0] + [-50.0] * 6, [0.036] * 2 + [0.15] * 6, cost)
    assert with_hopeless == without


# ---- the price of a verified token (the SLO phase's floor) ---------------------------------------------
def test_a_token_is_free_below_the_knee_and_priced_by_the_batch_rate_above_it() -> None:
    cands = [chain([0.9, 0.5])] * 4  # 4 roots + 8 drafted nodes
    roofline = lambda k: 0.03 + 0.001 * max(0, k - 64)  # noqa: E731 - flat to 64 tokens, then 1 ms a token
    assert token_price(cands, budget=8, t_spent_s=0.01, t_target=roofline) == 0.0  # 8 + 16 tokens still flat
    linear = lambda k: 0.02 + 0.001 * k  # noqa: E731
    # B = 8: the roots and the four 0.9 nodes, E = 4 + 3.6 = 7.6 tokens in 0.01 + 0.028 s, a token 1 ms more
    assert np.isclose(token_price(cands, budget=8, t_spent_s=0.01, t_target=linear), 7.6 / 0.038 * 0.001)
    # a budget beyond every node is priced at every node
    assert np.isclose(token_price(cands, budget=100, t_spent_s=0.0, t_target=linear), 9.6 / 0.032 * 0.001)
    assert token_price([], budget=8, t_spent_s=0.0, t_target=linear) == 0.0


def test_the_values_sorted_once_give_both_rules_their_own_answer() -> None:
    """The engine sorts the batch's f(v) once (drafted_values) and hands it to the budget rules and the price."""
    cands = [chain([0.9, 0.5, 0.2]), chain([0.6]), chain([0.99, 0.3])]
    values = drafted_values(cands)
    assert values.tolist() == sorted(np.exp(np.concatenate([c.log_probs[1:] for c in cands])).tolist(), reverse=True)
    linear = lambda k: 0.02 + 0.004 * k  # noqa: E731
    for floor in (3, 4, 6, 9):
        assert goodput_budget(cands, floor=floor, t_spent_s=0.01, t_target=linear, values=values) == goodput_budget(
            cands, floor=floor, t_spent_s=0.01, t_target=linear)
        assert token_price(cands, budget=floor, t_spent_s=0.01, t_target=linear, values=values) == token_price(
            cands, budget=floor, t_spent_s=0.01, t_target=linear)
    slo = {"base": np.array([1.0, -2.0, 3.0]), "rate": np.array([100.0, 0.0, 50.0]), "margin": np.zeros(3),
           "depth": 3, "n_max": 16, "order": "smallest-need", "t_spent_s": 0.01, "t_target": linear}
    assert slo_budget(cands, values=values, **slo) == slo_budget(cands, **slo)
