"""admission.py: admit, queue or shed, over a Directory fed by a fake worker list."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import pytest

from adaserve.gateway.admission import Admission, Admitted, Refused, Waiter, rank, reserved_classes, wait_budget_s
from adaserve.gateway.directory import Directory
from adaserve.gateway.metrics import GatewayMetrics
from adaserve.gateway.routing import Router
from adaserve.gateway.settings import GatewaySettings
from adaserve.gateway.slo import DEFAULT_CLASSES, SloCatalog, SloClass
from tests.gateway.unit.fakes import FakeSource, curve, registration
from tests.gateway.unit.helpers import run

# besides coding (priority 10, 40 ms), chat (0, 50 ms) and summarization (-1, 150 ms): chat's priority with a
# tighter and a looser target
VOICE = SloClass(name="voice", tpot_ms=30, priority=0)
BATCH = SloClass(name="batch", tpot_ms=100, priority=0)
CATALOG = SloCatalog.of([*DEFAULT_CLASSES, VOICE, BATCH], "chat")
CODING, CHAT, SUMMARIZATION = CATALOG.classes["coding"], CATALOG.classes["chat"], CATALOG.classes["summarization"]

# A worker that is quick alone (30 ms per token: every class can be met by a lone request) and slow with company
# (400 ms per token from two requests on): busy with one request, no class has slack there, but it has free slots.
QUICK_ALONE = {"budget": 16, "measured": curve((1, 30.0, 1.0), (2, 400.0, 1.0))}
BUSY = {**QUICK_ALONE, "active": 1, "by_class": {"chat": 1}}
# 200 ms per token even alone: every class (30-150 ms) is infeasible there
SLOW = {"budget": 16, "measured": curve((1, 200.0, 1.0), (2, 400.0, 1.0))}


def admission(docs: list[dict[str, Any]], **settings: Any) -> tuple[Admission, Directory, GatewayMetrics]:
    s = GatewaySettings(workers=["http://x"], **{"queue_timeout_s": 0.2, "refresh_s": 0.05, "retry_after_s": 7,
                                                  **settings})
    directory = Directory(FakeSource(docs), refresh_s=s.refresh_s, suspect_s=s.suspect_s)
    metrics = GatewayMetrics()
    return Admission(directory, Router(s.routing), CATALOG, s, metrics), directory, metrics


async def timed_admit(adm: Admission, slo: SloClass, *, model: str | None = None,
                      exclude: set[str] | None = None) -> tuple[Admitted | Refused, float]:
    await adm.directory.refresh()
    start = time.monotonic()
    try:
        out: Admitted | Refused = await adm.admit(slo, model=model, exclude=exclude or set())
    except Refused as e:
        out = e
    return out, time.monotonic() - start


def queued(metrics: GatewayMetrics) -> float | None:
    return metrics.registry.get_sample_value("adaserve_gateway_queued")


def test_slack_available_is_admitted_on_the_first_look() -> None:
    adm, _, _ = admission([registration("a", max_active=4), registration("b", max_active=4, active=2)])
    out, _ = run(timed_admit(adm, CHAT))
    assert isinstance(out, Admitted) and not out.queued and out.mode == "slo"
    assert out.choice.worker.id == "a" and out.choice.slack == pytest.approx(0.75) and out.choice.best == 0.75
    assert adm.waiting == 0


def test_sheddable_class_under_overload_is_shed_at_once() -> None:
    assert SUMMARIZATION.sheddable
    adm, _, metrics = admission([registration("a", **BUSY)], queue_timeout_s=30.0)
    out, elapsed = run(timed_admit(adm, SUMMARIZATION))
    assert isinstance(out, Refused)
    assert (out.status, out.reason, out.code, out.retry_after) == (503, "shed", "shed", 7)
    assert "summarization" in out.message
    assert elapsed < 30.0 and adm.waiting == 0 and queued(metrics) == 0  # never queued


def test_non_sheddable_class_waits_then_is_refused() -> None:
    assert not CHAT.sheddable
    adm, _, metrics = admission([registration("a", **BUSY)])
    out, elapsed = run(timed_admit(adm, CHAT))
    assert isinstance(out, Refused)
    assert (out.status, out.reason, out.retry_after) == (503, "overloaded", 7)
    assert "'chat'" in out.message and "0.2s" in out.message
    assert elapsed >= 0.18  # it waited for slack first
    assert adm.waiting == 0 and queued(metrics) == 0


def test_on_overload_best_effort_serves_late_after_the_wait() -> None:
    adm, _, metrics = admission([registration("a", **BUSY)], on_overload="best-effort")
    out, elapsed = run(timed_admit(adm, CHAT))
    assert isinstance(out, Admitted) and out.queued and out.mode == "late"
    assert out.choice.worker.id == "a" and out.choice.best < 0
    assert elapsed >= 0.18
    assert adm.waiting == 0 and queued(metrics) == 0


def test_a_ttft_target_shortens_the_wait_by_what_the_worker_adds() -> None:
    # coding's TTFT target is 2 s; the least TTFT the worker recently gave coding is 1.9 s: 0.1 s left to wait
    ttft = {"measured": {**BUSY["measured"], "classes": {"coding": {"finished": 3, "met": 3, "attainment": 1.0,
                                                                   "ttft_ms": 2500.0, "min_ttft_ms": 1900.0}}}}
    adm, _, _ = admission([registration("a", **{**BUSY, **ttft})], queue_timeout_s=30.0)
    out, elapsed = run(timed_admit(adm, CODING))
    assert isinstance(out, Refused) and out.reason == "overloaded" and "0.1s" in out.message
    assert elapsed >= 0.09
    assert wait_budget_s(CODING, 30.0, 1900.0) == pytest.approx(0.1)
    # once this gateway has served coding requests, what they took from admission to a first token counts instead
    adm.directory.calibration.observe_ttft("coding", 1500.0)
    assert adm.budget_s(CODING, adm.directory.usable()) == pytest.approx(0.5)
    assert wait_budget_s(CODING, 30.0, 2500.0) == 0.0  # its target is spent already: refused on its first look
    assert wait_budget_s(CODING, 1.0, None) == 1.0 and wait_budget_s(CHAT, 5.0, 1900.0) == 5.0


def test_no_workers_is_refused_after_the_queue_timeout() -> None:
    adm, _, metrics = admission([])
    out, elapsed = run(timed_admit(adm, CHAT))
    assert isinstance(out, Refused)
    assert (out.status, out.reason, out.retry_after) == (503, "no_workers", 7)
    assert elapsed >= 0.18
    assert adm.waiting == 0 and queued(metrics) == 0


def test_only_other_models_is_no_workers() -> None:
    adm, _, _ = admission([registration("a", model="other")], queue_timeout_s=0.0)
    out, _ = run(timed_admit(adm, CHAT, model="m"))
    assert isinstance(out, Refused) and out.reason == "no_workers"


def test_every_worker_full_is_overloaded_after_the_queue_timeout() -> None:
    adm, _, _ = admission([registration("a", max_active=2, active=2)])
    out, elapsed = run(timed_admit(adm, CHAT))
    assert isinstance(out, Refused)
    assert (out.status, out.reason) == (503, "overloaded") and "request limit" in out.message
    assert elapsed >= 0.18


def test_full_queue_refuses_at_once() -> None:
    adm, _, _ = admission([], max_queued=0, queue_timeout_s=30.0)
    out, elapsed = run(timed_admit(adm, CHAT))
    assert isinstance(out, Refused)
    assert (out.status, out.reason, out.retry_after) == (503, "queue_full", 7)
    assert elapsed < 30.0 and adm.waiting == 0


def test_queue_holds_max_queued_requests() -> None:
    adm, _, metrics = admission([], max_queued=1, queue_timeout_s=0.3)

    async def main() -> tuple[Admitted | Refused, Admitted | Refused, int, float | None]:
        first = asyncio.create_task(timed_admit(adm, CHAT))
        await asyncio.sleep(0.05)
        waiting, gauge = adm.waiting, queued(metrics)
        second, _ = await timed_admit(adm, CHAT)
        return (await first)[0], second, waiting, gauge

    first, second, waiting, gauge = run(main())
    assert waiting == 1 and gauge == 1
    assert isinstance(second, Refused) and second.reason == "queue_full"
    assert isinstance(first, Refused) and first.reason == "no_workers"
    assert adm.waiting == 0


def test_a_release_wakes_a_waiting_request() -> None:
    # refresh_s is long: only the release (a request ending here) can wake the waiting one before its timeout
    adm, directory, _ = admission([registration("a", max_active=1)], queue_timeout_s=30.0, refresh_s=30.0)

    async def main() -> tuple[Admitted | Refused, float]:
        await directory.refresh()
        directory.acquire("a", "chat")
        waiter = asyncio.create_task(timed_admit(adm, CHAT))
        await asyncio.sleep(0.05)
        directory.release("a", "chat")
        return await waiter

    out, elapsed = run(main())
    assert isinstance(out, Admitted) and out.choice.worker.id == "a" and out.queued
    assert elapsed < 30.0


def test_excluded_workers_are_not_chosen() -> None:
    # every worker excluded (each failed this request) is rule 6: a wait of worker_wait_s for another, then
    # no_workers; shortened here from its 30 s default
    adm, _, _ = admission([registration("a", max_active=4), registration("b", max_active=4, active=2)],
                          worker_wait_s=0.3)
    out, _ = run(timed_admit(adm, CHAT, exclude={"a"}))
    assert isinstance(out, Admitted) and out.choice.worker.id == "b"
    out, waited = run(timed_admit(adm, CHAT, exclude={"a", "b"}))
    assert isinstance(out, Refused) and out.reason == "no_workers"
    assert 0.3 <= waited < 5.0


# ---- classes no worker can meet ----------------------------------------------------------------------------------


def test_an_infeasible_class_is_served_best_effort_at_once_on_an_idle_worker() -> None:
    adm, _, _ = admission([registration("a", **SLOW)], queue_timeout_s=30.0)
    for slo in (CODING, SUMMARIZATION):
        out, _ = run(timed_admit(adm, slo))
        assert isinstance(out, Admitted) and not out.queued and out.mode == "best_effort", slo.name
    assert adm.infeasible(CODING, adm.directory.usable())


def test_best_effort_still_keeps_the_others_targets() -> None:
    # 100 ms alone: coding (40) is infeasible, summarization (150) is not; with two requests, 400 ms
    middling = {"budget": 16, "measured": curve((1, 100.0, 1.0), (2, 400.0, 1.0))}
    adm, _, _ = admission([registration("a", **middling, active=1, by_class={"summarization": 1})])
    out, _ = run(timed_admit(adm, CODING))  # would slow the summarization request to 400 ms: wait, then refuse
    assert isinstance(out, Refused) and out.reason == "overloaded"
    # nor does it join a request whose class the worker cannot meet alone either (chat, 50 ms): it would slow
    # that one to four times its lone pace, and itself too; alone, it goes in at once
    adm, _, _ = admission([registration("a", **middling, active=1, by_class={"chat": 1})])
    out, _ = run(timed_admit(adm, CODING))
    assert isinstance(out, Refused) and out.reason == "overloaded"
    adm, _, _ = admission([registration("a", **middling)])
    out, _ = run(timed_admit(adm, CODING))
    assert isinstance(out, Admitted) and out.mode == "best_effort" and not out.queued


def test_a_best_effort_request_waits_for_a_worker_that_serves_it_about_as_well_as_alone() -> None:
    # coding (36 ms with the margin) is met by no lone request: 40 ms on "a", 60 on "b" (summarization: 150)
    fast = {"budget": 16, "measured": curve((1, 40.0, 1.0), (2, 60.0, 1.0))}
    slow = {"budget": 16, "measured": curve((1, 60.0, 1.0), (2, 80.0, 1.0))}
    busy = registration("a", **fast, active=1, by_class={"summarization": 1})
    adm, _, _ = admission([busy, registration("b", **slow)])
    out, _ = run(timed_admit(adm, CODING))  # joining "a" makes 60 ms, 1.5x its pace there: the idle "b" (60)
    assert isinstance(out, Admitted) and out.mode == "best_effort" and out.choice.worker.id == "b"


def test_on_infeasible_refuse_names_the_class_and_the_fastest_lone_request() -> None:
    adm, _, _ = admission([registration("a", **SLOW)], on_infeasible="refuse", queue_timeout_s=30.0)
    out, _ = run(timed_admit(adm, CODING))
    assert isinstance(out, Refused)
    assert (out.status, out.reason, out.retry_after) == (503, "slo_infeasible", 7)
    assert "'coding'" in out.message and "200 ms per token" in out.message and "even for a lone request" in out.message
    assert adm.waiting == 0


# ---- admission none: a plain load balancer ---------------------------------------------------------------------


def test_admission_none_sends_to_any_free_slot_at_once() -> None:
    adm, _, _ = admission([registration("a", **BUSY)], admission="none", queue_timeout_s=30.0)
    for slo in (SUMMARIZATION, CHAT):  # neither shed nor queued, though nobody's target holds
        out, _ = run(timed_admit(adm, slo))
        assert isinstance(out, Admitted) and not out.queued and out.mode == "plain" and out.choice.best < 0
    adm, _, _ = admission([registration("a", max_active=1, active=1)], admission="none")
    out, elapsed = run(timed_admit(adm, CHAT))
    assert isinstance(out, Refused) and out.reason == "overloaded" and elapsed >= 0.18


# ---- the queue's order -----------------------------------------------------------------------------------


def test_rank_is_priority_then_tighter_target_then_arrival() -> None:
    arrivals = [(CHAT, 3), (SUMMARIZATION, 0), (CHAT, 1), (BATCH, 2), (VOICE, 5), (CODING, 4)]
    ordered = sorted(arrivals, key=lambda a: rank(*a))
    # coding's priority beats voice's tighter target; the two chats keep their arrival order
    assert ordered == [(CODING, 4), (VOICE, 5), (CHAT, 1), (CHAT, 3), (BATCH, 2), (SUMMARIZATION, 0)]


async def take(adm: Admission, slo: SloClass, order: list[str], label: str | None = None) -> Admitted | Refused:
    """Admit as service.open does, taking the worker the moment admission answers; log who went in ``order``."""
    label = label or slo.name
    try:
        admitted = await adm.admit(slo, model=None, exclude=set())
    except Refused as e:
        order.append(f"{label}:{e.reason}")
        return e
    adm.directory.acquire(admitted.choice.worker.id, slo.name)
    order.append(label)
    return admitted


async def settle() -> None:
    await asyncio.sleep(0.05)


async def until(done: Callable[[], bool], timeout_s: float = 1.0) -> None:
    end = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < end, "timed out"
        await asyncio.sleep(0.01)


async def full_worker(max_active: int = 1, **settings: Any) -> tuple[Admission, Directory, GatewayMetrics]:
    """One worker with every slot taken by chat; only a release (refresh_s is long) wakes a waiter."""
    adm, directory, metrics = admission([registration("a", max_active=max_active, **settings.pop("doc", {}))],
                                        **{"queue_timeout_s": 5.0, "refresh_s": 10.0, **settings})
    await directory.refresh()
    for _ in range(max_active):
        directory.acquire("a", "chat")
    return adm, directory, metrics


@pytest.mark.parametrize(("early", "late"), [(CHAT, CODING), (CHAT, VOICE), (VOICE, CODING)],
                         ids=["higher-priority", "tighter-target", "priority-before-target"])
def test_the_waiter_ranked_first_takes_the_slot_that_frees(early: SloClass, late: SloClass) -> None:
    async def main() -> tuple[list[str], list[str], float | None]:
        adm, directory, metrics = await full_worker()
        order: list[str] = []
        first = asyncio.create_task(take(adm, early, order))
        await settle()
        second = asyncio.create_task(take(adm, late, order))
        await settle()
        assert adm.waiting == 2 and queued(metrics) == 2
        directory.release("a", "chat")  # one slot
        await until(lambda: len(order) == 1)
        await settle()
        after_one = list(order)
        directory.release("a", late.name)
        await asyncio.gather(first, second)
        return after_one, order, queued(metrics)

    after_one, order, gauge = run(main())
    assert after_one == [late.name]  # the later but higher-ranked one; the other still waits
    assert order == [late.name, early.name]
    assert gauge == 0


def test_equal_classes_go_in_arrival_order() -> None:
    # refresh_s 0.2: the first waiter's own wake-up (at 0.2) puts it behind the second in the directory's wake
    # list, so the slot freed at 0.25 goes to whoever wakes first unless admission keeps the order
    async def main() -> list[str]:
        adm, directory, _ = await full_worker(refresh_s=0.2)
        order: list[str] = []
        first = asyncio.create_task(take(adm, CHAT, order, "first"))
        await asyncio.sleep(0.1)
        second = asyncio.create_task(take(adm, CHAT, order, "second"))
        await asyncio.sleep(0.15)
        directory.release("a", "chat")
        await until(lambda: len(order) == 1)
        directory.release("a", "chat")
        await asyncio.gather(first, second)
        return order

    assert run(main()) == ["first", "second"]


def test_a_new_request_does_not_jump_the_queue() -> None:
    async def main() -> tuple[list[str], int]:
        adm, directory, _ = await full_worker()
        order: list[str] = []
        first = asyncio.create_task(take(adm, CHAT, order, "first"))
        await settle()
        directory.release("a", "chat")
        asyncio.get_running_loop().call_later(0.1, directory.release, "a", "chat")
        await take(adm, CHAT, order, "second")  # arrives as the slot frees, before the waiter has run
        await first
        return order, adm.waiting

    assert run(main()) == (["first", "second"], 0)


def test_a_waiter_ranked_ahead_without_headroom_holds_nobody_back() -> None:
    # 30 ms alone but 45 ms with two: chat (50 ms) and batch (100 ms) have slack on a free slot, coding (40) not
    slow = {"budget": 16, "measured": curve((1, 30.0, 1.0), (2, 45.0, 1.0), (3, 45.0, 1.0))}

    async def main() -> tuple[list[str], list[str], int, float | None]:
        adm, directory, metrics = await full_worker(max_active=2, doc=slow, queue_timeout_s=1.0)
        order: list[str] = []
        tasks = []
        for slo in (CODING, BATCH, CHAT):  # ranked coding, chat, batch
            tasks.append(asyncio.create_task(take(adm, slo, order)))
            await settle()
        directory.release("a", "chat")  # one slot: coding has no headroom there, chat and batch have
        await until(lambda: len(order) == 1)
        await settle()
        after_one = list(order)
        directory.release("a", "chat")
        await asyncio.gather(*tasks)
        return after_one, order, adm.waiting, queued(metrics)

    after_one, order, waiting, gauge = run(main())
    assert after_one == ["chat"]  # not coding (no headroom for 40 ms), not batch (ranked behind chat)
    assert order == ["chat", "batch", "coding:overloaded"]  # coding: every slot taken at its deadline
    assert waiting == 0 and gauge == 0


def test_a_waiter_that_stood_aside_is_woken_when_the_one_ahead_leaves() -> None:
    # two slots free at once and no further change to the workers: whoever stood aside for coding must be
    # woken by coding's leaving, not by the next refresh (10 s) or its own deadline (5 s)
    async def main() -> tuple[list[str], float]:
        adm, directory, _ = await full_worker(max_active=2)
        order: list[str] = []
        chat = asyncio.create_task(take(adm, CHAT, order))
        await settle()
        coding = asyncio.create_task(take(adm, CODING, order))
        await settle()
        start = time.monotonic()
        directory.release("a", "chat")
        directory.release("a", "chat")
        await asyncio.gather(chat, coding)
        return order, time.monotonic() - start

    order, elapsed = run(main())
    assert order == ["coding", "chat"]
    assert elapsed < 5.0  # woken, not timed out


def test_a_cancelled_waiter_leaves_the_queue_and_blocks_nobody() -> None:
    async def main() -> tuple[list[str], int, float | None, bool, list[str], float | None]:
        adm, directory, metrics = await full_worker()
        order: list[str] = []
        gone = asyncio.create_task(take(adm, CODING, order, "gone"))
        await settle()
        chat = asyncio.create_task(take(adm, CHAT, order))
        await settle()
        coding = asyncio.create_task(take(adm, CODING, order))
        await settle()
        assert adm.waiting == 3
        directory.release("a", "chat")  # a slot, and the waiter ranked first is gone (its client disconnected)
        gone.cancel()
        await until(lambda: len(order) == 1)
        await settle()
        after_one, waiting, gauge = list(order), adm.waiting, queued(metrics)
        directory.release("a", "coding")
        await asyncio.gather(chat, coding)
        return after_one, waiting, gauge, gone.cancelled(), order, queued(metrics)

    after_one, waiting, gauge, cancelled, order, final_gauge = run(main())
    assert cancelled
    assert after_one == ["coding"] and waiting == 1 and gauge == 1  # the second coding, promptly; chat waits
    assert order == ["coding", "chat"]
    assert final_gauge == 0


def test_a_starving_waiter_still_leaves_at_its_queue_timeout() -> None:
    # coding requests keep taking the only slot; chat is never first, and gets its 503 at queue_timeout_s
    async def main() -> tuple[list[str], Admitted | Refused, float, int, float | None]:
        adm, directory, metrics = await full_worker(queue_timeout_s=0.6)
        directory.release("a", "chat")
        directory.acquire("a", "coding")
        order: list[str] = []
        start = time.monotonic()
        chat = asyncio.create_task(take(adm, CHAT, order))
        codings = []
        for _ in range(3):
            await asyncio.sleep(0.08)
            codings.append(asyncio.create_task(take(adm, CODING, order)))
            await asyncio.sleep(0.02)
            directory.release("a", "coding")
        out = await chat
        elapsed = time.monotonic() - start
        await asyncio.gather(*codings)
        return order, out, elapsed, adm.waiting, queued(metrics)

    order, out, elapsed, waiting, gauge = run(main())
    assert order == ["coding", "coding", "coding", "chat:overloaded"]
    assert isinstance(out, Refused) and out.reason == "overloaded"
    assert elapsed >= 0.55
    assert waiting == 0 and gauge == 0


def test_an_idle_worker_admits_a_feasible_class_at_once_whatever_the_prior_says() -> None:
    """Issue 15's invariant: the cost model (200 ms per iteration) says no class can be met, but the worker
    measured 30 ms per token alone: coding (40 ms) and the sheddable summarization go in on their first look."""
    slow_prior = {"cost_model": {"target": {"alpha": 0.0, "gamma": 0.0, "delta": 0.2}, "draft": None}}
    adm, _, _ = admission([registration("a", **QUICK_ALONE, **slow_prior)], queue_timeout_s=30.0)
    for slo in (CODING, SUMMARIZATION):
        out, _ = run(timed_admit(adm, slo))
        assert isinstance(out, Admitted) and out.choice.worker.id == "a", slo.name
        assert not out.queued and out.mode == "slo" and adm.waiting == 0


def test_the_idle_rule_keeps_the_routing_policys_pick() -> None:
    """Two idle workers under round-robin: admitted where the policy points, in turn."""
    docs = [registration(w, **QUICK_ALONE) for w in ("a", "b")]
    adm, _, _ = admission(docs, routing="round-robin")
    picks = []
    for _ in range(4):
        out, _ = run(timed_admit(adm, CODING))
        assert isinstance(out, Admitted) and not out.queued
        picks.append(out.choice.worker.id)
    assert sorted(picks) == ["a", "a", "b", "b"]


def test_admission_keeps_slo_margin_to_spare() -> None:
    # chat (50 ms) joining a worker holding one chat request: 46 ms each, within the target but not the 10% margin
    near = {"budget": 16, "measured": curve((1, 30.0, 1.0), (2, 46.0, 1.0))}
    adm, _, _ = admission([registration("a", **near, active=1, by_class={"chat": 1})])
    out, _ = run(timed_admit(adm, CHAT))
    assert isinstance(out, Refused) and out.reason == "overloaded"
    adm, _, _ = admission([registration("a", **near, active=1, by_class={"chat": 1})], slo_margin=0.0)
    out, _ = run(timed_admit(adm, CHAT))
    assert isinstance(out, Admitted) and out.mode == "slo" and not out.queued
    # a lone request within the target but not the margin: the class counts as infeasible, served best effort
    adm, _, _ = admission([registration("a", **near)])
    assert adm.target("chat") == pytest.approx(45.0)
    lone = {"budget": 16, "measured": curve((1, 48.0, 1.0))}
    adm, _, _ = admission([registration("a", **lone)], queue_timeout_s=30.0)
    out, _ = run(timed_admit(adm, CHAT))
    assert isinstance(out, Admitted) and out.mode == "best_effort" and not out.queued


def test_classes_are_reserved_while_one_waits_short_and_for_a_window_after() -> None:
    chat_short = [Waiter(CHAT, None, set(), 0, short=True)]
    assert reserved_classes({}, chat_short, None, 100.0, 5.0) == {"chat"}  # a chat waits without slack
    assert reserved_classes({}, chat_short, "other", 100.0, 5.0) == set()  # ... for another model
    assert reserved_classes({}, [Waiter(CHAT, None, set(), 0)], None, 100.0, 5.0) == set()  # not short (yet)
    pressed = {(None, "coding"): 96.0, (None, "chat"): 94.0, ("other", "voice"): 99.0}
    assert reserved_classes(pressed, [], None, 100.0, 5.0) == {"coding"}  # 4 s ago; the chat 6 s ago is over
    assert reserved_classes(pressed, chat_short, None, 100.0, 0.0) == {"chat"}  # window 0: only while it waits


# 30 ms per token alone, 40 with two requests, 400 from three: two chats (45 ms with the margin) fit together
PAIR = {"budget": 16, "measured": curve((1, 30.0, 1.0), (2, 40.0, 1.0), (3, 400.0, 1.0))}


def test_a_sheddable_request_leaves_the_headroom_to_a_waiting_chat() -> None:
    """Both slots taken by chat; a chat waits. A summary arriving meanwhile is refused at once; after the chat got
    in, within shed_window_s, a summary is refused while it would take the place the next chat needs (one chat
    left: a summary beside it leaves a chat three requests, 400 ms), and goes in once it leaves that place (the
    worker empty: with the summary a chat would be second, 40 ms)."""
    async def main() -> list[str]:
        adm, directory, _ = await full_worker(max_active=3, doc=PAIR, shed_window_s=60.0)
        directory.release("a", "chat")  # two chats: a third would be 400 ms
        order: list[str] = []
        chat = asyncio.create_task(take(adm, CHAT, order))
        await until(lambda: adm.waiting == 1)
        await take(adm, SUMMARIZATION, order, "summary-while-chat-waits")
        directory.release("a", "chat")  # one chat: the waiting chat goes in
        await chat
        directory.release("a", "chat")
        await take(adm, SUMMARIZATION, order, "summary-beside-a-chat")
        directory.release("a", "chat")
        await take(adm, SUMMARIZATION, order, "summary-on-an-empty-worker")
        return order

    assert run(main()) == ["summary-while-chat-waits:shed", "chat", "summary-beside-a-chat:shed",
                           "summary-on-an-empty-worker"]


def test_without_a_window_the_reservation_ends_with_the_wait() -> None:
    async def main() -> list[str]:
        adm, directory, _ = await full_worker(max_active=3, doc=PAIR, shed_window_s=0.0)
        directory.release("a", "chat")
        order: list[str] = []
        chat = asyncio.create_task(take(adm, CHAT, order))
        await until(lambda: adm.waiting == 1)
        directory.release("a", "chat")
        await chat
        directory.release("a", "chat")  # one chat: a summary fits beside it (40 ms), no chat waits now
        await take(adm, SUMMARIZATION, order, "summary")
        return order

    assert run(main()) == ["chat", "summary"]


def test_a_waiter_that_needs_the_worker_nearly_alone_keeps_summaries_from_filling_it() -> None:
    """Coding (36 ms with the margin) is met only alone on a worker at 30 / 38 / 44 ms per token with one, two,
    three requests. With two chats there it waits. A summary that fits (the chats' 45 ms hold at three) is
    refused all the same: it would keep the worker from draining to where coding fits (loadtest run 6: letting
    summaries fill such gaps admitted no chat or coding request at 2x). Once the chats are gone, coding goes in."""
    trio = {"budget": 16, "measured": curve((1, 30.0, 1.0), (2, 38.0, 1.0), (3, 44.0, 1.0), (4, 400.0, 1.0))}

    async def main() -> list[str]:
        adm, directory, _ = await full_worker(max_active=4, doc=trio, shed_window_s=5.0)
        directory.release("a", "chat")
        directory.release("a", "chat")  # two chats left
        order: list[str] = []
        coding = asyncio.create_task(take(adm, CODING, order))
        await until(lambda: adm.waiting == 1)
        assert adm.queue[0].short
        await take(adm, SUMMARIZATION, order, "summary")
        await take(adm, CHAT, order, "chat")  # a non-sheddable class is not held back by the reservation
        for name in ("chat", "chat", "chat"):  # idle: coding goes in
            directory.release("a", name)
        await coding
        return order

    assert run(main()) == ["summary:shed", "chat", "coding"]


def test_a_class_a_worker_cannot_meet_alone_reserves_no_room_there() -> None:
    """The waiting chat cannot be met on "slow" even alone: a summary goes there though a chat waits."""
    slow = {"budget": 16, "measured": curve((1, 60.0, 1.0), (2, 70.0, 1.0))}
    fast = registration("fast", max_active=1, **PAIR)
    adm, directory, _ = admission([fast, registration("slow", max_active=2, **slow)], queue_timeout_s=5.0,
                                  refresh_s=10.0, shed_window_s=60.0)

    async def main() -> list[str]:
        await directory.refresh()
        directory.acquire("fast", "chat")
        order: list[str] = []
        chat = asyncio.create_task(take(adm, CHAT, order))
        await until(lambda: adm.waiting == 1)
        out = await adm.admit(SUMMARIZATION, model=None, exclude=set())
        order.append(f"summary@{out.choice.worker.id}")
        directory.acquire(out.choice.worker.id, "summarization")
        directory.release("fast", "chat")
        await chat
        return order

    assert run(main()) == ["summary@slow", "chat"]


def test_an_idle_fleet_admits_a_sheddable_request_at_once() -> None:
    adm, _, _ = admission([registration("a", **QUICK_ALONE)])
    out, _ = run(timed_admit(adm, SUMMARIZATION))
    assert isinstance(out, Admitted) and not out.queued and out.mode == "slo"
