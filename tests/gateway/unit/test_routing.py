"""prediction.py and routing.py: TPOT predicted from a worker's measured curve, the prior, slack, and each policy
of Router.choose."""

from __future__ import annotations

import math
from typing import Any

import pytest

from adaserve.engine.cost.cost_model import even_cells
from adaserve.gateway.prediction import (
    CONTEXT_TOKENS,
    MIN_DECODES,
    MIN_STEPS,
    PRIOR_ACCEPTANCE,
    _cost,
    accepted_per_request,
    class_tokens_at,
    curve_slope,
    feasible,
    iteration_ms_at,
    iteration_s,
    lone_tpot_ms,
    pooled_acceptance,
    predicted_tpot_ms,
    prior_tokens,
    tokens_at,
)
from adaserve.gateway.routing import (
    BEST_EFFORT_ROOM,
    TIE,
    Router,
    best_slack,
    feasible_anywhere,
    limit_ms,
    room_for,
    slack,
    with_one_more,
)
from adaserve.gateway.view import DRAFT_STEPS, CurvePoint, WorkerView
from tests.gateway.unit.helpers import view

# T = alpha * context + gamma * batched + delta (seconds)
TARGET = {"alpha": 1e-6, "gamma": 1e-4, "delta": 0.01}
DRAFT = {"alpha": 0.0, "gamma": 1e-4, "delta": 0.001}
TPOTS = {"tight": 30.0, "chat": 50.0, "relaxed": 150.0}
# a worker's measured curve: 20 ms alone gaining 2 tokens, 30 ms with two requests gaining 1.5, 50 ms with four
CURVE = (CurvePoint(1, 32, 20.0, 2.0), CurvePoint(2, 32, 30.0, 1.5), CurvePoint(4, 16, 50.0, 1.25))


def tpot_of(name: str) -> float | None:
    return TPOTS.get(name)


def modelled(id: str = "w", **kw: Any) -> WorkerView:
    """A worker with a cost model (B = 64, acceptance rate 0.5) and no measurements yet."""
    fields: dict[str, Any] = {"max_active": 8, "active": 0, "budget": 64, "target_cost": TARGET,
                              "draft_cost": DRAFT, "acceptance_rate": 0.5}
    return view(id, **{**fields, **kw})


def measured(id: str = "w", **kw: Any) -> WorkerView:
    """A worker that has measured CURVE."""
    return modelled(id, **{"curve": CURVE, **kw})


def test_constants_the_hand_numbers_assume() -> None:
    assert (CONTEXT_TOKENS, DRAFT_STEPS, PRIOR_ACCEPTANCE, MIN_STEPS, MIN_DECODES) == (512, 4, 0.6, 4, 4)


# ---- the measured curve ---------------------------------------------------------------------------------------

@pytest.mark.parametrize(("n", "ms"), [(1, 20.0), (2, 30.0), (4, 50.0), (3, 40.0), (1.5, 25.0)])
def test_iteration_time_at_and_between_measured_points(n: float, ms: float) -> None:
    assert iteration_ms_at(measured(), n) == pytest.approx(ms)


def test_iteration_time_beyond_the_curve_follows_its_least_squares_slope() -> None:
    # weights 32, 32, 16: mean n = 2, mean T = 30; sxy = 32*(-1)(-10) + 0 + 16*2*20 = 960, sxx = 32 + 0 + 64 = 96
    assert curve_slope(CURVE) == pytest.approx(10.0)
    assert iteration_ms_at(measured(), 6) == pytest.approx(70.0)
    # below the first point: the same line, but never under half the first point
    shifted = tuple(CurvePoint(p.requests + 2, p.steps, p.iteration_ms) for p in CURVE)
    assert iteration_ms_at(measured(curve=shifted), 2) == pytest.approx(10.0)
    assert iteration_ms_at(measured(curve=shifted), 1) == pytest.approx(10.0)  # 0 by the line, floored


def test_a_decreasing_curve_does_not_extrapolate_downwards() -> None:
    noisy = (CurvePoint(1, 8, 30.0, 2.0), CurvePoint(2, 8, 25.0, 2.0))
    assert curve_slope(noisy) == 0.0
    assert iteration_ms_at(measured(curve=noisy), 5) == pytest.approx(25.0)


def test_one_point_scales_as_the_prior_does() -> None:
    one = (CurvePoint(1, 32, 20.0, 2.0),)
    w = measured(curve=one)
    assert iteration_ms_at(w, 3) == pytest.approx(20.0 * iteration_s(w, 3) / iteration_s(w, 1))  # type: ignore[operator]
    # without a cost model: in proportion to the requests
    assert iteration_ms_at(view(curve=one), 3) == pytest.approx(60.0)


def test_points_with_few_iterations_are_not_trusted() -> None:
    shaky = (CurvePoint(1, MIN_STEPS - 1, 500.0, 1.0), *CURVE[1:])
    assert iteration_ms_at(measured(curve=shaky), 1) == pytest.approx(30.0 - 10.0)  # the line through 2 and 4
    only_shaky = (CurvePoint(1, 1, 500.0, 1.0),)
    assert iteration_ms_at(modelled(curve=only_shaky), 1) == pytest.approx(1e3 * iteration_s(modelled(), 1))  # type: ignore[operator]


@pytest.mark.parametrize(("n", "e"), [(1, 2.0), (2, 1.5), (3, 1.375), (4, 1.25), (9, 1.25)])
def test_tokens_per_iteration_from_the_curve_nearest_beyond_its_ends(n: float, e: float) -> None:
    assert tokens_at(measured(), n) == pytest.approx(e)


def test_prefill_only_points_say_nothing_about_tokens() -> None:
    curve = (CurvePoint(1, 32, 20.0, None), CurvePoint(2, 32, 30.0, 1.5))
    assert tokens_at(measured(curve=curve), 1) == pytest.approx(1.5)


def test_predicted_tpot_is_iteration_time_over_tokens() -> None:
    assert predicted_tpot_ms(measured(), "chat", 1) == pytest.approx(10.0)
    assert predicted_tpot_ms(measured(), "chat", 4) == pytest.approx(40.0)
    assert predicted_tpot_ms(view(), "chat", 1) is None  # neither curve nor cost model


def test_a_class_measured_on_the_curve_is_predicted_from_its_own_figures() -> None:
    # summaries accept little (1.1 tokens per iteration), chat a lot (2.6): same iterations, TPOT 2.4x apart
    curve = (CurvePoint(1, 32, 20.0, 1.0, {"summarization": (1.1, 20)}),
             CurvePoint(3, 32, 40.0, 1.8, {"chat": (2.6, 40), "summarization": (1.2, 40), "rare": (5.0, 3)}))
    w = measured(curve=curve, class_accepted={"chat": 3.0, "rare": 0.5})
    assert class_tokens_at(w, "summarization", 1) == pytest.approx(1.1)
    assert class_tokens_at(w, "summarization", 2) == pytest.approx(1.15)  # between the points
    assert class_tokens_at(w, "chat", 1) == pytest.approx(2.6)  # the nearest point that measured it
    assert class_tokens_at(w, "chat", 5) == pytest.approx(2.6)
    assert predicted_tpot_ms(w, "chat", 3) == pytest.approx(40 / 2.6)
    # too few decodes of "rare" on the curve: what its finished requests accepted per verification, plus one
    assert class_tokens_at(w, "rare", 3) == pytest.approx(1.5)
    # a class nobody measured: the curve's figure over all classes
    assert class_tokens_at(w, "unknown", 3) == pytest.approx(1.8)
    assert class_tokens_at(measured(class_accepted={"chat": 3.0}), "chat", 2) == pytest.approx(4.0)


def test_a_class_is_timed_by_the_iterations_it_was_in_where_it_has_a_figure() -> None:
    # alone, a summary's iteration costs 60 ms and a chat's 20 ms; the point's mean (40) is neither's
    curve = (CurvePoint(1, 32, 40.0, 2.0, {"summarization": (1.0, 20), "chat": (3.0, 20), "rare": (2.0, 3)},
                        {"summarization": 60.0, "chat": 20.0, "rare": 90.0}),
             CurvePoint(3, 32, 90.0, 1.8, {"chat": (2.0, 40)}, {"chat": 84.0}))
    w = measured(curve=curve)
    assert iteration_ms_at(w, 1) == pytest.approx(40.0)
    assert iteration_ms_at(w, 1, slo_class="summarization") == pytest.approx(60.0)
    assert predicted_tpot_ms(w, "summarization", 1) == pytest.approx(60.0)
    assert predicted_tpot_ms(w, "chat", 1) == pytest.approx(20.0 / 3.0)
    assert iteration_ms_at(w, 2, slo_class="chat") == pytest.approx(52.0)  # between its own figures
    assert iteration_ms_at(w, 2, slo_class="summarization") == pytest.approx(75.0)  # its own, then the shared
    assert iteration_ms_at(w, 1, slo_class="rare") == pytest.approx(40.0)  # too few decodes: the shared time
    # slack judges every class on the worker by its own time
    busy = measured(curve=curve, active=1, active_by_class={"summarization": 1})
    assert slack(busy, "chat", {"chat": 30.0, "summarization": 200.0}.get) == pytest.approx(
        min(1 - 52.0 / 2.5 / 30.0, 1 - 75.0 / 1.0 / 200.0))


# ---- the prior (a worker that has not served yet) -------------------------------------------------------

def test_prior_iteration_verifies_the_budget_and_drafts_d_steps() -> None:
    # n=2: T_target(1024, B=64) = 1.024e-3 + 6.4e-3 + 0.01 = 0.017424; T_draft(1024, 2) = 2e-4 + 1e-3 = 0.0012
    assert iteration_s(modelled(), 2) == pytest.approx(0.022224)
    assert iteration_ms_at(modelled(), 2) == pytest.approx(22.224)


def test_prior_uses_the_context_and_depth_the_worker_reports() -> None:
    assert iteration_s(modelled(context_per_request=100.0, draft_steps=2), 2) == pytest.approx(0.0166 + 2 * 0.0012)
    assert iteration_s(modelled(draft_steps=0), 2) == iteration_s(modelled(draft_cost=None), 2)
    assert iteration_s(modelled(draft_cost=None), 2) == pytest.approx(0.011224)  # one forward of n tokens
    assert iteration_s(modelled(budget=None), 2) is None and iteration_s(view(), 2) is None


def test_prior_prices_the_attention_cells_a_worker_publishes() -> None:
    """A CPU worker's cost model reads each request's context once per new token (beta): n=2 verifying B=64 tokens
    reads each 512-token context 32 times and its 32 tokens as a causal chunk, 1024 x 32 + 2 x 32 x 33 / 2 cells; a
    draft step's one token a request, 1024 + 2 cells."""
    cells = {**TARGET, "beta": 1e-7}
    draft = {**DRAFT, "beta": 1e-7}
    want = 0.017424 + 1e-7 * (1024 * 32 + 32 * 33) + 4 * (0.0012 + 1e-7 * (1024 + 2))
    assert iteration_s(modelled(target_cost=cells, draft_cost=draft), 2) == pytest.approx(want)


@pytest.mark.parametrize(("n_context", "n_batched", "n"), [(1024, 64, 2), (0, 256, 1), (5000, 32, 32), (300, 7, 3)])
def test_the_priors_cells_are_the_engines(n_context: int, n_batched: int, n: int) -> None:
    """The gateway may not import the engine: its prior counts a batch's cells as ``cost_model.even_cells`` does."""
    beta_only = {"alpha": 0.0, "gamma": 0.0, "delta": 0.0, "beta": 1.0}
    assert _cost(beta_only, n_context, n_batched, n) == pytest.approx(even_cells(n_context, n_batched, n), rel=1e-12)


@pytest.mark.parametrize(("a", "k", "m"), [
    (0.5, 4, 0.9375), (0.5, 1.5, 1 - 0.5**1.5), (1.0, 3, 3.0), (0.0, 4, 0.0), (0.7, 0, 0.0), (0.7, -0.5, 0.0),
])
def test_accepted_per_request(a: float, k: float, m: float) -> None:
    assert accepted_per_request(a, k) == pytest.approx(m)


def test_prior_tokens_a_chain_of_the_trees_depth() -> None:
    assert prior_tokens(modelled(), 2, None) == pytest.approx(1.9375)  # k = min(4, 31) at a = 0.5
    assert prior_tokens(modelled(acceptance_rate=None), 2, None) == pytest.approx(1 + 1.3056)  # a = 0.6
    assert prior_tokens(modelled(), 2, 0.6) == pytest.approx(1 + 1.3056)  # the pooled rate wins
    assert prior_tokens(modelled(budget=8), 4, None) == pytest.approx(1.5)  # k = 8/4 - 1 = 1
    assert prior_tokens(modelled(draft_cost=None), 1, None) == 1.0
    assert tokens_at(modelled(), 2) == pytest.approx(1.9375)


def test_pooled_acceptance_is_the_mean_of_published_rates() -> None:
    assert pooled_acceptance([modelled(acceptance_rate=0.5), modelled(acceptance_rate=0.7), view()]) == 0.6
    assert pooled_acceptance([view()]) is None and pooled_acceptance([]) is None


# ---- slack ------------------------------------------------------------------------------------------------------

def test_slack_of_an_idle_worker_is_the_lone_requests_margin() -> None:
    assert slack(measured(), "chat", tpot_of) == pytest.approx(1 - 10 / 50)
    assert slack(measured(), "tight", tpot_of) == pytest.approx(1 - 10 / 30)


def test_slack_is_the_tightest_margin_of_every_class_on_the_worker() -> None:
    # joining makes 4: T = 50, E = 1.25, TPOT 40 for everyone; tight (30 ms) is already there and breaks
    w = measured(active=3, active_by_class={"chat": 2, "tight": 1})
    assert slack(w, "relaxed", tpot_of) == pytest.approx(1 - 40 / 30)
    assert slack(measured(active=3, active_by_class={"chat": 3}), "relaxed", tpot_of) == pytest.approx(1 - 40 / 50)
    assert slack(measured(active=3, active_by_class={"gone": 3}), "relaxed", tpot_of) == pytest.approx(1 - 40 / 150)


def test_the_correction_scales_every_prediction() -> None:
    w = measured(correction=2.0)
    assert slack(w, "chat", tpot_of) == pytest.approx(1 - 20 / 50)
    assert lone_tpot_ms(w, "chat") == pytest.approx(20.0)


def test_a_class_the_worker_cannot_meet_alone_is_held_to_its_lone_pace_there() -> None:
    # tight (5 ms) is met by no lone request (10 ms): held to 10 * (1 + BEST_EFFORT_ROOM) = 11 ms instead
    assert limit_ms(measured(), "tight", lambda _: 5.0) == pytest.approx(10.0 * (1 + BEST_EFFORT_ROOM))
    assert limit_ms(measured(), "tight", lambda _: 30.0) == 30.0  # met alone: its own target
    assert limit_ms(measured(), "nameless", lambda _: None) is None
    # served best effort (no worker can meet it alone), it is judged so too; otherwise by its target
    assert slack(measured(), "tight", lambda _: 5.0, best_effort=True) == pytest.approx(1 - 10 / 11)
    assert slack(measured(), "tight", lambda _: 5.0) == pytest.approx(1 - 10 / 5)
    busy = measured(active=1, active_by_class={"chat": 1})  # n = 2: TPOT 20, twice its lone pace
    tight = {"tight": 5.0, "chat": 50.0}.get
    assert slack(busy, "tight", tight, best_effort=True) == pytest.approx(1 - 20 / 11)


def test_a_class_the_worker_cannot_meet_even_alone_holds_others_to_its_lone_pace() -> None:
    # tight (30 ms) cannot be met alone at correction 4 (40 ms): chat (100 ms) joining makes 2, 4 * 20 = 80 ms
    w = measured(active=1, active_by_class={"tight": 1}, correction=4.0)
    targets = {"tight": 30.0, "chat": 100.0}
    assert feasible(w, "tight", targets.get) is False
    assert slack(w, "chat", targets.get) == pytest.approx(1 - 80 / 44)  # tight's 40 ms alone, plus 10%
    # without the tight request there the chat would keep its target
    assert slack(measured(correction=4.0), "chat", targets.get) == pytest.approx(1 - 40 / 100)


def test_no_free_slot_is_minus_infinite_slack() -> None:
    for w in (measured(max_active=2, active=2), view(max_active=1, active=1), view(max_active=2, active=5)):
        assert slack(w, "relaxed", tpot_of) == -math.inf


def test_a_worker_nothing_predicts_is_judged_by_its_free_slots() -> None:
    w = view(max_active=8, active=3, active_by_class={"tight": 3})
    assert slack(w, "tight", tpot_of) == pytest.approx((5 - 1) / 8)
    assert slack(view(max_active=4, active=3), "chat", tpot_of) == 0.0  # the last slot: still admissible


def test_feasible_means_a_lone_request_meets_the_target() -> None:
    assert feasible(measured(), "tight", tpot_of) is True  # 10 ms alone
    assert feasible(measured(correction=4.0), "tight", tpot_of) is False  # 40 ms alone
    assert feasible(view(), "tight", tpot_of) is None
    assert feasible(measured(), "nameless", tpot_of) is None
    fast, slow = measured("fast"), measured("slow", correction=4.0)
    assert feasible_anywhere([slow, fast], "tight", tpot_of) and not feasible_anywhere([slow], "tight", tpot_of)
    assert feasible_anywhere([slow, view("unknown")], "tight", tpot_of)  # one that cannot be judged may
    assert feasible_anywhere([], "tight", tpot_of)


# ---- Router.choose -----------------------------------------------------------------------------------------------

def test_headroom_policy_picks_the_most_slack() -> None:
    busy = measured("a", active=1, active_by_class={"tight": 1})  # n = 2: TPOT 20 against 30: slack 1/3
    calm = measured("b", active=3, active_by_class={"relaxed": 3})  # n = 4: 40 against 50: 0.2 (chat joins)
    choice = Router("headroom").choose([calm, busy], "chat", tpot_of)
    assert choice is not None and choice.worker.id == "a"
    assert choice.slack == pytest.approx(1 / 3) and choice.best == choice.slack
    assert choice.predicted_tpot_ms == pytest.approx(20.0)


def test_slacks_within_tie_are_equal_and_fewer_requests_wins() -> None:
    fewer = measured("a", active=1, active_by_class={"relaxed": 1})  # 1 - 20/150
    more = measured("b", active=2, active_by_class={"relaxed": 2}, curve=(CurvePoint(3, 32, 20.0, 2.0),))
    assert abs(slack(fewer, "relaxed", tpot_of) - slack(more, "relaxed", tpot_of)) < TIE
    choice = Router("headroom").choose([more, fewer], "relaxed", tpot_of)
    assert choice is not None and choice.worker.id == "a"


def test_the_headroom_policy_never_trades_a_kept_target_for_fewer_requests() -> None:
    # a keeps chat's target by a hair (slack 0.02), b holds fewer requests but would miss it (-0.05): within TIE
    a = measured("a", active=2, curve=(CurvePoint(3, 32, 49.0, 1.0),))
    b = measured("b", active=1, curve=(CurvePoint(2, 32, 52.5, 1.0),))
    choice = Router("headroom").choose([a, b], "chat", tpot_of)
    assert choice is not None and choice.worker.id == "a" and choice.best == pytest.approx(0.02)


def test_least_loaded_and_round_robin_pick_among_workers_that_keep_the_targets() -> None:
    keeps = measured("a", active=3, max_active=4, active_by_class={"relaxed": 3})  # 40 ms for chat: ok
    breaks = measured("b", active=3, max_active=8, active_by_class={"tight": 3})  # tight breaks at n = 4
    for policy in ("least-loaded", "round-robin"):
        router = Router(policy)
        for _ in range(3):
            choice = router.choose([breaks, keeps], "chat", tpot_of)
            assert choice is not None and choice.worker.id == "a", policy
    plain = Router("least-loaded").choose([breaks, keeps], "chat", tpot_of, keep_targets=False)
    assert plain is not None and plain.worker.id == "b"  # a plain load balancer: the lowest share of slots in use


def test_round_robin_cycles_through_open_workers_in_id_order() -> None:
    router = Router("round-robin")
    workers = [view("c"), view("a"), view("full", max_active=1, active=1), view("b")]
    picked = []
    for _ in range(4):
        choice = router.choose(workers, "chat", tpot_of)
        assert choice is not None
        picked.append(choice.worker.id)
    assert picked == ["a", "b", "c", "a"]


@pytest.mark.parametrize("policy", ["headroom", "least-loaded", "round-robin"])
def test_no_free_slot_anywhere_is_none(policy: str) -> None:
    full = [view("a", max_active=1, active=1), measured("b", max_active=2, active=2)]
    assert Router(policy).choose(full, "chat", tpot_of) is None
    assert Router(policy).choose([], "chat", tpot_of) is None
    assert best_slack(full, "chat", tpot_of) is None


@pytest.mark.parametrize("policy", ["headroom", "least-loaded", "round-robin"])
def test_best_slack_is_the_fleets_maximum_whatever_the_policy(policy: str) -> None:
    workers = [measured("a", active=3, active_by_class={"tight": 3}), measured("b"), view("c", active=6)]
    best = max(slack(w, "chat", tpot_of) for w in workers)
    router = Router(policy)
    for _ in range(3):
        choice = router.choose(workers, "chat", tpot_of)
        assert choice is not None and choice.best == pytest.approx(best) == best_slack(workers, "chat", tpot_of)
        assert choice.slack <= choice.best


def test_best_slack_moves_no_round_robin_cursor() -> None:
    router = Router("round-robin")
    workers = [view("b"), view("a")]
    first = router.choose(workers, "chat", tpot_of)
    best_slack(workers, "chat", tpot_of)
    second = router.choose(workers, "chat", tpot_of)
    assert first is not None and second is not None and (first.worker.id, second.worker.id) == ("a", "b")


def test_unknown_policy_is_refused() -> None:
    with pytest.raises(ValueError, match="random"):
        Router("random")


def test_room_for_keeps_the_workers_that_still_fit_a_reserved_class_after_the_request_joined() -> None:
    # on CURVE a tight request (30 ms) is met with up to three requests (29 ms at three, 40 at four)
    one = measured("one", active=1, active_by_class={"relaxed": 1})
    two = measured("two", active=2, active_by_class={"relaxed": 2})
    assert with_one_more(one, "relaxed").active_by_class == {"relaxed": 2}
    assert [w.id for w in room_for([one, two], "relaxed", {"tight"}, tpot_of)] == ["one"]
    assert [w.id for w in room_for([one, two], "relaxed", set(), tpot_of)] == ["one", "two"]
    full = measured("full", active=8, max_active=8)
    assert room_for([full], "relaxed", {"chat"}, tpot_of) == []  # no place left for the chat
    # a class the worker cannot meet even alone (10 ms alone against 5) reserves nothing there
    assert [w.id for w in room_for([two], "relaxed", {"tight"}, {"tight": 5.0, "relaxed": 150.0}.get)] == ["two"]
