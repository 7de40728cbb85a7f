"""routing.py: the headroom formula against hand-computed numbers, and each policy of Router.choose."""

from __future__ import annotations

import math
from typing import Any

import pytest

from adaserve.gateway.routing import (
    CONTEXT_TOKENS,
    DRAFT_STEPS,
    PRIOR_ACCEPTANCE,
    TIE,
    Router,
    WorkerView,
    accepted_per_request,
    best_headroom,
    headroom,
    iteration_s,
    pooled_acceptance,
)
from tests.gateway.unit.helpers import view

# T = alpha * context + gamma * batched + delta (seconds)
TARGET = {"alpha": 1e-6, "gamma": 1e-4, "delta": 0.01}
DRAFT = {"alpha": 0.0, "gamma": 1e-4, "delta": 0.001}
TPOTS = {"tight": 10.0, "chat": 50.0, "relaxed": 150.0}


def tpot_of(name: str) -> float | None:
    return TPOTS.get(name)


def modelled(id: str = "w", **kw: Any) -> WorkerView:
    """A worker with a cost model, B = 64, acceptance rate a = 0.5 and one chat request running."""
    fields: dict[str, Any] = {"max_active": 8, "active": 1, "active_by_class": {"chat": 1}, "budget": 64,
                              "target_cost": TARGET, "draft_cost": DRAFT, "acceptance_rate": 0.5}
    return view(id, **{**fields, **kw})


def test_constants_the_hand_numbers_assume() -> None:
    assert (CONTEXT_TOKENS, DRAFT_STEPS, PRIOR_ACCEPTANCE) == (512, 4, 0.6)


# ---- iteration_s -------------------------------------------------------------------------------------------

def test_iteration_s_verifies_the_budget_and_drafts_d_steps() -> None:
    # n=2: T_target(1024, B=64) = 1.024e-3 + 6.4e-3 + 0.01 = 0.017424; T_draft(1024, 2) = 2e-4 + 1e-3 = 0.0012
    assert iteration_s(modelled(), 2) == pytest.approx(0.022224)


def test_iteration_s_uses_the_context_and_depth_the_worker_reports() -> None:
    # L = 100 per request, D = 2; n=2: T_target(200, 64) = 2e-4 + 6.4e-3 + 0.01; T_draft(200, 2) = 2e-4 + 1e-3
    assert iteration_s(modelled(context_per_request=100.0, draft_steps=2), 2) == pytest.approx(0.0166 + 2 * 0.0012)


def test_a_worker_reporting_depth_0_is_judged_without_a_tree() -> None:
    w = modelled(draft_steps=0)
    assert iteration_s(w, 2) == iteration_s(modelled(draft_cost=None), 2)
    # no tree: nothing is accepted beyond the bonus token, so a request needs t <= T_target to fit
    assert headroom(w, 50.0, tpot_of) == pytest.approx(0.0)


def test_iteration_s_batches_at_least_one_token_per_request() -> None:
    # B=1 < n=3: T_target(1536, 3) = 1.536e-3 + 3e-4 + 0.01 = 0.011836; T_draft(1536, 3) = 3e-4 + 1e-3
    assert iteration_s(modelled(budget=1), 3) == pytest.approx(0.011836 + 4 * 0.0013)


def test_iteration_s_without_draft_is_one_target_forward_of_n_tokens() -> None:
    # no speculation: T_target(1024, n=2) = 1.024e-3 + 2e-4 + 0.01, the budget plays no part
    assert iteration_s(modelled(draft_cost=None), 2) == pytest.approx(0.011224)


@pytest.mark.parametrize("missing", ["target_cost", "budget"])
def test_iteration_s_needs_a_cost_model_and_a_budget(missing: str) -> None:
    assert iteration_s(modelled(**{missing: None}), 2) is None


# ---- accepted_per_request ----------------------------------------------------------------------------------

@pytest.mark.parametrize(("a", "k", "m"), [
    (0.5, 4, 0.9375),  # 0.5 + 0.25 + 0.125 + 0.0625
    (0.6, 4, 0.6 + 0.36 + 0.216 + 0.1296),
    (0.5, 1.5, 1 - 0.5**1.5),  # a fractional tree size interpolates
    (1.0, 3, 3.0),  # every draft token accepted
    (0.0, 4, 0.0),
    (0.7, 0, 0.0),
    (0.7, -0.5, 0.0),  # fewer budget tokens than requests: no tree at all
])
def test_accepted_per_request(a: float, k: float, m: float) -> None:
    assert accepted_per_request(a, k) == pytest.approx(m)


# ---- headroom ----------------------------------------------------------------------------------------------

def test_headroom_by_hand_for_a_tight_request() -> None:
    # n=2, k = min(4, 64/2 - 1) = 4, m = 0.9375; own need = t / 10ms = 2.2224 (1.2224 beyond the bonus token);
    # the running chat request needs 0.44448 < 1  ->  0.9375 - 1.2224 / 2 = 0.3263 (reach 5 - 2.2224 is larger)
    assert headroom(modelled(), 10.0, tpot_of) == pytest.approx(0.9375 - 1.2224 / 2)


def test_headroom_by_hand_for_a_relaxed_request() -> None:
    # need 0.14816 < 1: no extra demand, headroom = m
    assert headroom(modelled(), 150.0, tpot_of) == pytest.approx(0.9375)


def test_tighter_class_has_less_headroom() -> None:
    w = modelled()
    assert headroom(w, 10.0, tpot_of) < headroom(w, 50.0, tpot_of)


def test_running_tight_requests_reduce_headroom() -> None:
    mixes = [{"chat": 3}, {"chat": 2, "tight": 1}, {"chat": 1, "tight": 2}, {"tight": 3}]
    rooms = [headroom(modelled(active=3, active_by_class=mix), 50.0, tpot_of) for mix in mixes]
    assert rooms == sorted(rooms, reverse=True) and len(set(rooms)) == len(rooms)
    # n=4: t = 0.018448 + 4 * 0.0014 = 0.024048; each tight request needs 2.4048, 1.4048 beyond its bonus token
    assert rooms[0] == pytest.approx(0.9375)
    assert rooms[-1] == pytest.approx(0.9375 - 3 * 1.4048 / 4)
    assert rooms[-1] < 0  # three tight requests already use more than the tree gives


def test_running_requests_of_unknown_classes_add_no_demand() -> None:
    assert headroom(modelled(active_by_class={"gone": 1}), 50.0, tpot_of) == pytest.approx(0.9375)


def test_prior_acceptance_before_any_verification() -> None:
    # a = 0.6 until the worker publishes its acceptance rate: m = 0.6 + 0.36 + 0.216 + 0.1296 = 1.3056
    assert headroom(modelled(acceptance_rate=None), 50.0, tpot_of) == pytest.approx(1.3056)


def test_an_assumed_acceptance_overrides_the_workers_own() -> None:
    assert headroom(modelled(acceptance_rate=0.5), 50.0, tpot_of, acceptance=0.6) == pytest.approx(1.3056)
    assert headroom(modelled(acceptance_rate=None), 50.0, tpot_of, acceptance=0.5) == pytest.approx(0.9375)


def test_pooled_acceptance_is_the_mean_of_published_rates() -> None:
    assert pooled_acceptance([modelled(acceptance_rate=0.5), modelled(acceptance_rate=0.7), view()]) == 0.6
    assert pooled_acceptance([view(), modelled(acceptance_rate=None)]) is None
    assert pooled_acceptance([]) is None


def test_the_budget_caps_each_requests_tree() -> None:
    # B=8, n=2: k = min(4, 8/2 - 1) = 3, m = 0.5 + 0.25 + 0.125; t = T_target(1024, 8) + 4 * 0.0012 = 0.016624
    assert headroom(modelled(budget=8), 150.0, tpot_of) == pytest.approx(0.875)
    # 4 ms: need 4.156 > 1 + k = 4 -> negative even though a perfect acceptance would supply m = 3
    assert headroom(modelled(budget=8, acceptance_rate=1.0), 4.0, tpot_of) == pytest.approx(4 - 0.016624 / 0.004)


def test_without_draft_a_request_needing_more_than_one_token_has_no_headroom() -> None:
    w = modelled(draft_cost=None)  # t = 0.011224; k = 0: a tree cannot help
    assert headroom(w, 50.0, tpot_of) == pytest.approx(0.0)
    assert headroom(w, 10.0, tpot_of) == pytest.approx(1.0 - 1.1224)  # reach: 1 - need


def test_need_beyond_one_plus_d_is_negative_whatever_the_acceptance() -> None:
    # 4 ms: need = 0.022224 / 0.004 = 5.556 > 1 + D = 5; with a = 1 the supply would leave 4 - 4.556 / 2 > 0
    room = headroom(modelled(acceptance_rate=1.0), 4.0, tpot_of)
    assert room == pytest.approx(5 - 5.556)
    assert room < 0


def test_no_cost_model_falls_back_to_free_slot_share() -> None:
    w = view(max_active=8, active=3, active_by_class={"tight": 3})
    assert headroom(w, 1.0, tpot_of) == pytest.approx((5 - 1) / 8)  # share of slots still free after joining
    assert headroom(w, 1000.0, tpot_of) == headroom(w, 1.0, tpot_of)  # the target plays no part
    assert headroom(view(max_active=4, active=3), 50.0, tpot_of) == 0.0  # the last slot: still admissible
    assert headroom(modelled(budget=None), 1.0, tpot_of) == pytest.approx((7 - 1) / 8)  # cost model, no budget


@pytest.mark.parametrize("w", [view(max_active=4, active=4), modelled(max_active=1, active=1),
                               view(max_active=2, active=5)])
def test_full_worker_has_minus_infinite_headroom(w: WorkerView) -> None:
    assert headroom(w, 150.0, tpot_of) == -math.inf


# ---- Router.choose -----------------------------------------------------------------------------------------

def test_headroom_policy_picks_the_most_headroom() -> None:
    busy = modelled("a", active=1, active_by_class={"tight": 1})  # 0.9375 - 1.2224 / 2: fewer requests, less room
    calm = modelled("b", active=3, active_by_class={"chat": 3})  # 0.9375
    assert headroom(calm, 50.0, tpot_of) - headroom(busy, 50.0, tpot_of) > TIE
    choice = Router("headroom").choose([busy, calm], 50.0, tpot_of)
    assert choice is not None and choice.worker.id == "b"
    assert choice.headroom == pytest.approx(0.9375)
    assert choice.best_headroom == choice.headroom


def test_headroom_ties_go_to_the_worker_with_fewer_active() -> None:
    a = view("a", max_active=8, active=3)  # 5/8 - 1/8 = 0.5
    b = view("b", max_active=4, active=1)  # 3/4 - 1/4 = 0.5, fewer requests running
    for order in ([a, b], [b, a]):
        choice = Router("headroom").choose(order, 50.0, tpot_of)
        assert choice is not None and choice.worker.id == "b" and choice.headroom == 0.5


def test_headroom_within_tie_counts_as_equal_and_fewer_active_wins() -> None:
    fewer = view("a", max_active=4, active=1)  # 0.5
    roomier = view("b", max_active=10, active=2)  # 0.7: within TIE of the best
    choice = Router("headroom").choose([fewer, roomier], 50.0, tpot_of)
    assert choice is not None and choice.worker.id == "a"
    assert choice.best_headroom == pytest.approx(0.7)
    much_roomier = view("b", max_active=20, active=2)  # 0.85: beyond TIE, room wins over fewer requests
    choice = Router("headroom").choose([fewer, much_roomier], 50.0, tpot_of)
    assert choice is not None and choice.worker.id == "b"


def test_router_judges_every_open_worker_at_the_pooled_acceptance() -> None:
    # one worker's recent window is noisy: 0.2 and 0.8 both count as their mean 0.5 (m = 0.9375); the full
    # worker's rate is not pooled
    workers = [modelled("a", acceptance_rate=0.2), modelled("b", acceptance_rate=0.8),
               modelled("c", acceptance_rate=1.0, max_active=1)]
    choice = Router("headroom").choose(workers, 50.0, tpot_of)
    assert choice is not None and choice.worker.id == "a"
    assert choice.headroom == pytest.approx(0.9375) and choice.best_headroom == pytest.approx(0.9375)


def test_least_loaded_picks_the_lowest_share_of_slots_in_use() -> None:
    a = view("a", max_active=4, active=2)  # half full
    b = view("b", max_active=8, active=3)  # more requests, lower share
    choice = Router("least-loaded").choose([a, b], 50.0, tpot_of)
    assert choice is not None and choice.worker.id == "b"


def test_round_robin_cycles_through_open_workers_in_id_order() -> None:
    router = Router("round-robin")
    workers = [view("c"), view("a"), view("full", max_active=1, active=1), view("b")]
    picked = []
    for _ in range(4):
        choice = router.choose(workers, 50.0, tpot_of)
        assert choice is not None
        picked.append(choice.worker.id)
    assert picked == ["a", "b", "c", "a"]


@pytest.mark.parametrize("policy", ["headroom", "least-loaded", "round-robin"])
def test_no_free_slot_anywhere_is_none(policy: str) -> None:
    full = [view("a", max_active=1, active=1), modelled("b", max_active=2, active=2)]
    assert Router(policy).choose(full, 50.0, tpot_of) is None
    assert Router(policy).choose([], 50.0, tpot_of) is None


@pytest.mark.parametrize("policy", ["headroom", "least-loaded", "round-robin"])
def test_best_headroom_is_the_fleets_maximum(policy: str) -> None:
    workers = [modelled("a", active=3, active_by_class={"tight": 3}), modelled("b"), view("c", active=6)]
    rooms = [headroom(w, 10.0, tpot_of) for w in workers]
    assert len(set(rooms)) == 3
    router = Router(policy)
    for _ in range(3):  # round-robin visits every worker; best stays the fleet's
        choice = router.choose(workers, 10.0, tpot_of)
        assert choice is not None
        assert choice.best_headroom == pytest.approx(max(rooms))
        assert choice.headroom == pytest.approx(headroom(choice.worker, 10.0, tpot_of))
        assert choice.headroom <= choice.best_headroom


def test_best_headroom_without_a_router_equals_the_choices() -> None:
    # what admission asks of a waiter ahead: the same number as Router.choose, at the pooled acceptance,
    # and no round-robin turn taken
    workers = [modelled("b", acceptance_rate=0.8), modelled("a", acceptance_rate=0.2), view("c", active=6),
               modelled("full", max_active=1, active=1, acceptance_rate=1.0)]
    for tpot in (10.0, 50.0, 150.0):
        choice = Router("headroom").choose(workers, tpot, tpot_of)
        assert choice is not None and best_headroom(workers, tpot, tpot_of) == choice.best_headroom
    router = Router("round-robin")
    first = router.choose(workers, 50.0, tpot_of)
    best_headroom(workers, 50.0, tpot_of)
    second = router.choose(workers, 50.0, tpot_of)
    assert first is not None and second is not None and (first.worker.id, second.worker.id) == ("a", "b")
    assert best_headroom([view("x", max_active=1, active=1)], 50.0, tpot_of) is None
    assert best_headroom([], 50.0, tpot_of) is None


def test_unknown_policy_is_refused() -> None:
    with pytest.raises(ValueError, match="random"):
        Router("random")
