"""tracker.py: what a request's life writes to the state store, judged by its class's targets (the rule
itself: tests/contract/test_slo.py)."""

from __future__ import annotations

from collections import Counter
from typing import Any

from adaserve.gateway.admission import Admitted
from adaserve.gateway.metrics import GatewayMetrics
from adaserve.gateway.routing import Choice
from adaserve.gateway.slo import SloClass
from adaserve.gateway.state import MemoryStore
from adaserve.gateway.tracker import Tracker
from tests.gateway.unit.helpers import run, view

CODING = SloClass(name="coding", tpot_ms=40, ttft_ms=2000)  # with a TTFT target
CHAT = SloClass(name="chat", tpot_ms=50)  # without


def admitted(worker: str, *, queued: bool = False) -> Admitted:
    return Admitted(Choice(view(worker), 0.25, 0.5, 20.0), 0.3 if queued else 0.0, queued, "slo")


def tracker(store: MemoryStore, slo: SloClass = CHAT) -> Tracker:
    return Tracker(store, GatewayMetrics(), 60, "req-1", slo, api_key="team-a", model="m")


def test_a_fast_request_is_recorded_as_met() -> None:
    store = MemoryStore()

    async def main() -> tuple[bool, bool]:
        t = tracker(store)
        await t.received()
        await t.routed("w1", admitted("w1", queued=True))
        t.on_tokens(1)
        t.on_tokens(0)  # an empty chunk is no token
        t.on_tokens(2)
        met = await t.finished("done", "stop")
        again = await t.finished("done", "stop")  # a second end is ignored
        return met, again

    met, again = run(main())
    assert met is True and again is False
    record = run(store.get_record("req-1"))
    assert record is not None
    assert {k: record[k] for k in ("id", "slo_class", "api_key", "model", "worker", "attempts", "status",
                                   "finish_reason", "tokens", "slo_met")} == {
        "id": "req-1", "slo_class": "chat", "api_key": "team-a", "model": "m", "worker": "w1", "attempts": "1",
        "status": "done", "finish_reason": "stop", "tokens": "3", "slo_met": "1"}
    assert float(record["ttft_ms"]) >= 0 and float(record["tpot_ms"]) < 50
    assert (record["queued"], record["queue_ms"], record["admission"], record["slack"]) == ("1", "300.0", "slo", "0.25")
    assert run(store.counters("chat")) == {"requests": 1, "finished": 1, "done": 1, "tokens": 3, "slo_met": 1}


def test_a_class_with_a_ttft_target_misses_on_a_slow_first_token() -> None:
    store = MemoryStore()

    async def main(waited_s: float) -> bool:
        t = tracker(store, CODING)
        t.arrival -= waited_s  # the first token comes this long after the request arrived
        await t.routed("w1", admitted("w1"))
        t.on_tokens(2)
        return await t.finished("done", "length")

    assert run(main(0.0)) is True
    assert run(main(2.5)) is False  # TPOT well within 40 ms, TTFT 2.5 s over the class's 2 s


def test_an_aborted_request_is_not_met_and_retries_are_counted() -> None:
    store = MemoryStore()

    async def main() -> bool:
        t = tracker(store)
        await t.routed("w1", admitted("w1"))
        await t.routed("w2", admitted("w2"))  # the first worker failed before a token
        t.on_tokens(1)
        return await t.finished("aborted", None)

    assert run(main()) is False
    record = run(store.get_record("req-1"))
    assert record is not None and (record["worker"], record["attempts"], record["slo_met"]) == ("w2", "2", "0")
    assert run(store.counters("chat")) == {"requests": 1, "retries": 1, "finished": 1, "aborted": 1, "tokens": 1}


def test_a_refused_request_counts_once_and_never_finishes() -> None:
    store = MemoryStore()

    async def main() -> bool:
        t = tracker(store)
        await t.refused("shed", "queue_full")
        return await t.finished("done", "stop")

    assert run(main()) is False
    record = run(store.get_record("req-1"))
    assert record is not None and (record["status"], record["reason"]) == ("shed", "queue_full")
    assert run(store.counters("chat")) == {"shed": 1}


class CountingStore(MemoryStore):
    """A MemoryStore that counts the calls a tracker makes (each one a round trip to Redis)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: Counter[str] = Counter()

    async def record(self, request_id: str, fields: dict[str, Any], *, ttl_s: int, slo_class: str | None = None,
                     counters: dict[str, int] | None = None) -> None:
        self.calls["record"] += 1
        await super().record(request_id, fields, ttl_s=ttl_s, slo_class=slo_class, counters=counters)

    async def count(self, slo_class: str, counters: dict[str, int]) -> None:
        self.calls["count"] += 1
        await super().count(slo_class, counters)


def test_each_step_writes_record_and_counters_in_one_store_call() -> None:
    store = CountingStore()

    async def main() -> list[dict[str, int]]:
        t = tracker(store)
        seen = []
        for step in (t.received(), t.routed("w1", admitted("w1")), t.routed("w2", admitted("w2")),
                     t.finished("done", "stop")):
            store.calls.clear()
            await step
            seen.append(dict(store.calls))
        return seen

    # routing a request (before it reaches the worker) and its end: one call each, counters included
    assert run(main()) == [{"record": 1}] * 4
    assert run(store.counters("chat")) == {"requests": 1, "retries": 1, "finished": 1, "done": 1, "tokens": 0,
                                             "slo_met": 1}
