"""directory.py: registrations as routing views, and the directory's merge of its own in-flight requests.

Which documents are registrations at all: tests/contract/test_registration.py."""

from __future__ import annotations

import asyncio
import copy
import time
from typing import Any

import pytest

from adaserve.contract.registration import parse_registration
from adaserve.gateway.directory import Directory, worker_view
from adaserve.gateway.prediction import predicted_tpot_ms
from adaserve.gateway.routing import Router
from adaserve.gateway.view import CurvePoint, WorkerView
from tests.contract.examples import REGISTRATION
from tests.gateway.unit.fakes import FakeSource, registration
from tests.gateway.unit.helpers import run


def doc(**changes: Any) -> dict[str, Any]:
    out = copy.deepcopy(REGISTRATION)
    out.update(changes)
    return out


def view_of(doc: Any) -> WorkerView | None:
    """The routing view of a document, None when it is no registration (the directory skips it)."""
    reg = parse_registration(doc)
    return None if reg is None else worker_view(reg)


# ---- worker_view -------------------------------------------------------------------------------------------

def test_parse_a_real_registration() -> None:
    assert view_of(REGISTRATION) == WorkerView(
        id="adaserve-worker-7d9f-abcde", address="http://10.0.3.17:8000", status="ready", model="target",
        max_active=64, active=3, active_by_class={"chat": 2, "coding": 1}, budget=582,
        target_cost={"alpha": 1.1e-7, "gamma": 2.0e-5, "delta": 0.011, "beta": 0.0},
        draft_cost={"alpha": 2.0e-8, "gamma": 4.0e-6, "delta": 0.002, "beta": 0.0}, acceptance_rate=0.31,
        context_per_request=1730 / 3, draft_steps=4, unloaded_tpot_ms=21.5, lone_tpot_ms=14.2,
        curve=(CurvePoint(1, 32, 31.0, 2.2, {"chat": (2.2, 30)}, {"chat": 31.0}),
               CurvePoint(3, 32, 38.5, 1.9, {"chat": (1.7, 60), "coding": (2.3, 30)},
                          {"chat": 39.0, "coding": 37.5})),
        class_accepted={"chat": 1.6, "coding": 2.0},
        class_ttft_ms={"chat": 31.0, "coding": 40.0})


def test_the_curve_is_read_in_order_of_requests() -> None:
    points = REGISTRATION["measured"]["iterations"]
    v = view_of(doc(measured={"iterations": points[::-1]}))
    assert v is not None and [p.requests for p in v.curve] == [1, 3]
    assert v.class_accepted == {} and v.class_ttft_ms == {}


@pytest.mark.parametrize(("load", "per_request"), [
    ({"running": 2, "waiting": 1, "context_tokens": 900}, 300.0),  # waiting requests hold their prompts too
    ({"running": 0, "waiting": 0, "context_tokens": 0}, None),  # holds nothing: routing assumes a typical one
    ({"running": 3}, None),  # an older worker that does not report it
])
def test_parse_context_per_request(load: dict[str, Any], per_request: float | None) -> None:
    v = view_of(doc(load={"active": 3, **load}))
    assert v is not None and v.context_per_request == per_request


def test_parse_a_worker_that_does_not_speculate_reports_depth_0() -> None:
    v = view_of(doc(max_depth=0))
    assert v is not None and v.draft_steps == 0 and v.depth == 0


def test_parse_a_worker_that_is_still_loading() -> None:
    # before the engine is built the registration has no budget or cost model, and nothing verified yet
    loading = {k: v for k, v in REGISTRATION.items() if k not in ("budget", "cost_model")}
    loading.update(status="loading", acceptance={"steps": 0, "mean_accepted_per_verification": 0.0,
                                                 "acceptance_rate": 0.0})
    v = view_of(loading)
    assert v is not None
    assert (v.status, v.budget, v.target_cost, v.draft_cost, v.acceptance_rate) == ("loading", None, None, None, None)


def test_parse_a_worker_without_draft() -> None:
    v = view_of(doc(cost_model={"source": "online", "target": {"alpha": 0.0, "gamma": 0.0, "delta": 0.1},
                                           "draft": None}))
    assert v is not None and v.draft_cost is None and v.target_cost == {"alpha": 0.0, "gamma": 0.0, "delta": 0.1,
                                                                        "beta": 0.0}  # an older worker: no cells


def test_parse_defaults_for_missing_optional_parts() -> None:
    v = view_of({"worker_id": 7, "address": "http://w", "status": "ready"})
    assert v == WorkerView(id="7", address="http://w", status="ready", model=None, max_active=1, active=0)


@pytest.mark.parametrize("cost_model", [
    {"target": {"alpha": 1e-7, "delta": 0.01}, "draft": None},  # a coefficient missing
    {"target": "fast", "draft": None},
    {"target": {"alpha": 1e-7, "gamma": 2e-5, "delta": 0.011}, "draft": {"a": 1}},
])
def test_a_malformed_cost_model_does_not_break_routing(cost_model: dict[str, Any]) -> None:
    # One foreign or older registration must not take routing down for every request: parse_registration
    # refuses it (None, so the directory skips it) and routing goes on over the others.
    assert view_of(doc(cost_model=cost_model)) is None
    other = view_of(doc(worker_id="healthy"))
    assert other is not None
    choice = Router("headroom").choose([other], "chat", lambda _: 50.0)
    assert choice is not None and choice.worker.id == "healthy"


# ---- Directory ---------------------------------------------------------------------------------------------

def directory(docs: list[dict[str, Any]], *, suspect_s: float = 60.0) -> tuple[Directory, FakeSource]:
    source = FakeSource(docs)
    d = Directory(source, refresh_s=10.0, suspect_s=suspect_s)
    run(d.refresh())
    return d, source


def by_id(views: list[WorkerView]) -> dict[str, WorkerView]:
    return {v.id: v for v in views}


def test_usable_raises_loads_to_own_in_flight_counts() -> None:
    d, _ = directory([registration("a", active=1, by_class={"chat": 1}),
                      registration("b", active=5, max_active=8, by_class={"chat": 5})])
    for cls in ("chat", "chat", "coding"):
        d.acquire("a", cls)
    d.acquire("b", "chat")
    views = by_id(d.usable())
    # a: the registration (one heartbeat old) shows 1; this gateway alone has 3 there now
    assert (views["a"].active, views["a"].active_by_class) == (3, {"chat": 2, "coding": 1})
    # b: the registration already counts more than this gateway's one request
    assert (views["b"].active, views["b"].active_by_class) == (5, {"chat": 5})
    assert views["a"].free_slots == 1
    d.release("a", "coding")
    d.release("a", "coding")  # more releases than acquires never go below zero
    views = by_id(d.usable())
    assert views["a"].active == 2 and views["a"].active_by_class.get("coding", 0) == 0
    assert by_id(d.all())["a"].active == 1  # all() is the registrations as read


def test_a_registration_is_read_as_what_it_was_when_written() -> None:
    """A registration written before this gateway's last request there ended still counts that request; one
    written before a request began here does not count it yet (load.effective)."""
    d, source = directory([])
    t0 = time.time()
    d.acquire("a", "chat")  # this gateway: one chat request since t0
    d.acquire("a", "coding")
    source.docs = [registration("a", active=3, by_class={"chat": 2, "coding": 1}, updated_at=time.time())]
    run(d.refresh())  # the worker counted ours and one chat request of someone else's
    assert by_id(d.usable())["a"].active_by_class == {"chat": 2, "coding": 1}
    d.release("a", "chat")  # ended here after the registration was written: not counted any more
    d.release("a", "coding")
    assert (by_id(d.usable())["a"].active, by_id(d.usable())["a"].active_by_class) == (1, {"chat": 1})
    d.acquire("a", "coding")  # begun since: counted at once
    assert by_id(d.usable())["a"].active_by_class == {"chat": 1, "coding": 1}
    # a registration written before any of this gateway's requests: all of it is someone else's
    source.docs = [registration("a", active=2, by_class={"chat": 2}, updated_at=t0 - 1)]
    run(d.refresh())
    assert by_id(d.usable())["a"].active_by_class == {"chat": 2, "coding": 1}


def test_the_correction_learnt_from_finished_requests_reaches_the_views() -> None:
    measured = {"iterations": [{"requests": 1, "steps": 32, "iteration_ms": 20.0, "tokens_verified": 2,
                                "tokens_per_request": 2.0},
                               {"requests": 2, "steps": 32, "iteration_ms": 30.0, "tokens_verified": 4,
                                "tokens_per_request": 1.5}]}
    d, _ = directory([registration("a", measured=measured, updated_at=time.time())])
    assert by_id(d.usable())["a"].correction == 1.0
    d.acquire("a", "chat")
    since = d.mark("a")
    time.sleep(0.05)
    lesson = d.learn("a", "chat", since, observed_ms=20.0, tokens=32)  # alone: predicted 10 ms, got 20
    assert lesson.predicted_ms == pytest.approx(10.0, rel=0.05) and lesson.load == pytest.approx(1.0)
    k = lesson.after
    assert lesson.before == 1.0 and k == pytest.approx(2 ** 0.2, rel=0.02) and by_id(d.usable())["a"].correction == k
    d.release("a", "chat")
    assert predicted_tpot_ms(by_id(d.usable())["a"], "chat", 1) == pytest.approx(10.0)  # raw: the correction apart


def test_usable_excludes_workers_that_are_not_ready() -> None:
    d, _ = directory([registration("a"), registration("b", status="draining"), registration("c", status="loading")])
    assert [v.id for v in d.usable()] == ["a"]
    assert sorted(v.id for v in d.all()) == ["a", "b", "c"]


def test_usable_excludes_suspected_workers() -> None:
    d, _ = directory([registration("a"), registration("b")])
    d.mark_failed("a")
    assert [v.id for v in d.usable()] == ["b"]
    run(d.refresh())  # re-reading the list does not clear the suspicion
    assert [v.id for v in d.usable()] == ["b"]


def test_suspicion_ends_after_suspect_s() -> None:
    d, _ = directory([registration("a")], suspect_s=0.05)
    d.mark_failed("a")
    assert d.usable() == []
    time.sleep(0.08)
    assert [v.id for v in d.usable()] == ["a"]


def test_usable_filters_by_model() -> None:
    d, _ = directory([registration("a", model="m1"), registration("b", model="m2"), registration("c", model=None)])
    assert sorted(v.id for v in d.usable("m1")) == ["a", "c"]  # a worker that names no model serves any
    assert sorted(v.id for v in d.usable("m2")) == ["b", "c"]
    assert sorted(v.id for v in d.usable()) == ["a", "b", "c"]
    assert d.models() == ["m1", "m2"]


def test_refresh_skips_garbage_and_keeps_the_last_list_on_error() -> None:
    d, source = directory([registration("a"), {"not": "a registration"}])
    assert [v.id for v in d.all()] == ["a"] and d.last_error is None
    source.docs = [registration("b")]
    source.error = OSError("connection refused")
    run(d.refresh())
    assert [v.id for v in d.all()] == ["a"] and d.last_error == "connection refused"
    source.error = None
    run(d.refresh())
    assert [v.id for v in d.all()] == ["b"] and d.last_error is None


def test_wait_change_wakes_on_release() -> None:
    async def main() -> tuple[bool, float]:
        d = Directory(FakeSource(), refresh_s=10.0, suspect_s=1.0)
        start = time.monotonic()
        waiter = asyncio.create_task(d.wait_change(5.0))
        await asyncio.sleep(0.05)
        early = waiter.done()
        d.release("w", "chat")
        await asyncio.wait_for(waiter, 2.0)
        return early, time.monotonic() - start

    early, elapsed = run(main())
    assert not early
    assert elapsed < 5.0  # woken, not timed out


def test_wait_change_wakes_on_refresh_and_times_out_otherwise() -> None:
    async def main() -> tuple[float, float]:
        d = Directory(FakeSource([registration("a")]), refresh_s=10.0, suspect_s=1.0)
        start = time.monotonic()
        await d.wait_change(0.1)
        idle = time.monotonic() - start
        waiter = asyncio.create_task(d.wait_change(5.0))
        await asyncio.sleep(0.02)
        start = time.monotonic()
        await d.refresh()
        await asyncio.wait_for(waiter, 2.0)
        return idle, time.monotonic() - start

    idle, woken = run(main())
    assert idle >= 0.09
    assert woken < 5.0


def test_start_reads_at_once_and_stop_closes_the_source() -> None:
    async def main() -> tuple[list[str], FakeSource]:
        source = FakeSource([registration("a")])
        d = Directory(source, refresh_s=0.02, suspect_s=1.0)
        await d.start()
        ids = [v.id for v in d.all()]
        source.docs = [registration("a"), registration("b")]
        await asyncio.sleep(0.1)  # the loop re-reads every refresh_s
        ids += [v.id for v in d.all()]
        await d.stop()
        return ids, source

    ids, source = run(main())
    assert ids == ["a", "a", "b"]
    assert source.closed and source.reads >= 3
