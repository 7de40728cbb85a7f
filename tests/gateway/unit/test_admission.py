"""admission.py: admit, queue or shed, over a Directory fed by a fake worker list."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from adaserve.gateway.admission import Admission, Refused
from adaserve.gateway.directory import Directory
from adaserve.gateway.metrics import GatewayMetrics
from adaserve.gateway.routing import Choice, Router
from adaserve.gateway.settings import GatewaySettings
from adaserve.gateway.slo import DEFAULT_CLASSES, SloCatalog, SloClass
from tests.gateway.unit.fakes import FakeSource, registration
from tests.gateway.unit.helpers import run

CATALOG = SloCatalog.of(list(DEFAULT_CLASSES), "chat")
CHAT, SUMMARIZATION = CATALOG.classes["chat"], CATALOG.classes["summarization"]  # priority 0 and -1

# 200 ms per iteration and no draft: no class (40, 50, 150 ms) can be met, but there are free slots
SLOW = {"budget": 16, "cost_model": {"target": {"alpha": 0.0, "gamma": 0.0, "delta": 0.2}, "draft": None}}


def admission(docs: list[dict[str, Any]], **settings: Any) -> tuple[Admission, Directory, GatewayMetrics]:
    s = GatewaySettings(workers=["http://x"], **{"queue_timeout_s": 0.2, "refresh_s": 0.05, "retry_after_s": 7,
                                                  **settings})
    directory = Directory(FakeSource(docs), refresh_s=s.refresh_s, suspect_s=s.suspect_s)
    metrics = GatewayMetrics()
    return Admission(directory, Router(s.routing), CATALOG, s, metrics), directory, metrics


async def timed_admit(adm: Admission, slo: SloClass, *, model: str | None = None,
                      exclude: set[str] | None = None) -> tuple[Choice | Refused, float]:
    await adm.directory.refresh()
    start = time.monotonic()
    try:
        out: Choice | Refused = await adm.admit(slo, model=model, exclude=exclude or set())
    except Refused as e:
        out = e
    return out, time.monotonic() - start


def queued(metrics: GatewayMetrics) -> float | None:
    return metrics.registry.get_sample_value("adaserve_gateway_queued")


def test_headroom_available_is_admitted_at_once() -> None:
    adm, _, metrics = admission([registration("a", max_active=4), registration("b", max_active=4, active=2)])
    out, elapsed = run(timed_admit(adm, CHAT))
    assert isinstance(out, Choice)
    assert out.worker.id == "a" and out.headroom == pytest.approx(0.75) and out.best_headroom == out.headroom
    assert elapsed < 0.1
    assert adm.waiting == 0
    assert metrics.registry.get_sample_value("adaserve_gateway_workers") == 2


def test_sheddable_class_under_overload_is_shed_at_once() -> None:
    assert SUMMARIZATION.sheddable
    adm, _, _ = admission([registration("a", **SLOW)])
    out, elapsed = run(timed_admit(adm, SUMMARIZATION))
    assert isinstance(out, Refused)
    assert (out.status, out.reason, out.code, out.retry_after) == (503, "shed", "shed", 7)
    assert "summarization" in out.message
    assert elapsed < 0.1  # no queueing
    assert adm.waiting == 0


def test_non_sheddable_class_waits_then_goes_best_effort() -> None:
    assert not CHAT.sheddable
    adm, _, metrics = admission([registration("a", **SLOW)])
    out, elapsed = run(timed_admit(adm, CHAT))
    assert isinstance(out, Choice)
    assert out.worker.id == "a" and out.best_headroom < 0
    assert 0.18 <= elapsed < 1.5  # ~queue_timeout_s
    assert adm.waiting == 0 and queued(metrics) == 0


def test_no_workers_is_refused_after_the_queue_timeout() -> None:
    adm, _, metrics = admission([])
    out, elapsed = run(timed_admit(adm, CHAT))
    assert isinstance(out, Refused)
    assert (out.status, out.reason, out.retry_after) == (503, "no_workers", 7)
    assert 0.18 <= elapsed < 1.5
    assert adm.waiting == 0 and queued(metrics) == 0


def test_only_other_models_is_no_workers() -> None:
    adm, _, _ = admission([registration("a", model="other")], queue_timeout_s=0.0)
    out, _ = run(timed_admit(adm, CHAT, model="m"))
    assert isinstance(out, Refused) and out.reason == "no_workers"


def test_every_worker_full_is_overloaded_after_the_queue_timeout() -> None:
    adm, _, _ = admission([registration("a", max_active=2, active=2)])
    out, elapsed = run(timed_admit(adm, CHAT))
    assert isinstance(out, Refused)
    assert (out.status, out.reason) == (503, "overloaded")
    assert 0.18 <= elapsed < 1.5


def test_full_queue_refuses_at_once() -> None:
    adm, _, _ = admission([], max_queued=0, queue_timeout_s=5.0)
    out, elapsed = run(timed_admit(adm, CHAT))
    assert isinstance(out, Refused)
    assert (out.status, out.reason, out.retry_after) == (503, "queue_full", 7)
    assert elapsed < 0.1
    assert adm.waiting == 0


def test_queue_holds_max_queued_requests() -> None:
    adm, _, metrics = admission([], max_queued=1, queue_timeout_s=0.3)

    async def main() -> tuple[Choice | Refused, Choice | Refused, int, float | None]:
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
    adm, directory, _ = admission([registration("a", max_active=1)], queue_timeout_s=5.0, refresh_s=10.0)

    async def main() -> tuple[Choice | Refused, float]:
        await directory.refresh()
        directory.acquire("a", "chat")
        waiter = asyncio.create_task(timed_admit(adm, CHAT))
        await asyncio.sleep(0.05)
        directory.release("a", "chat")
        return await waiter

    out, elapsed = run(main())
    assert isinstance(out, Choice) and out.worker.id == "a"
    assert elapsed < 1.0


def test_excluded_workers_are_not_chosen() -> None:
    adm, _, _ = admission([registration("a", max_active=4), registration("b", max_active=4, active=2)])
    out, _ = run(timed_admit(adm, CHAT, exclude={"a"}))
    assert isinstance(out, Choice) and out.worker.id == "b"
    out, _ = run(timed_admit(adm, CHAT, exclude={"a", "b"}))
    assert isinstance(out, Refused) and out.reason == "no_workers"
