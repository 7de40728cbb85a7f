"""One request's record: its class, worker, status, tokens, TTFT, TPOT and SLO outcome, kept in the state
store (with a TTL) and in the metrics. A state store that is down never fails the request itself.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

from redis.exceptions import RedisError

from adaserve.contract.slo import mean_tpot_ms, slo_met, ttft_ms
from adaserve.gateway.admission import Admitted
from adaserve.gateway.directory import Lesson
from adaserve.gateway.metrics import GatewayMetrics
from adaserve.gateway.slo import SloClass
from adaserve.gateway.state import StateStore

log = logging.getLogger(__name__)

@dataclass
class Tracker:
    store: StateStore
    metrics: GatewayMetrics
    ttl_s: int
    request_id: str
    slo: SloClass
    api_key: str | None = None
    model: str | None = None
    arrival: float = field(default_factory=time.monotonic)
    worker: str | None = None
    attempts: int = 0
    tokens: int = 0
    first_s: float | None = None
    last_s: float | None = None
    ended: bool = False
    decoding_since: tuple[float, float] | None = None  # the worker's load mark at the first token (directory.mark)
    lesson: Lesson | None = None  # its TPOT as predicted at the load it decoded under (set as it leaves)
    waited_s: float | None = None  # in admission, before the worker that served it

    async def _write(self, fields: dict[str, Any], counters: dict[str, int] | None = None) -> None:
        try:
            await self.store.record(self.request_id, fields, ttl_s=self.ttl_s, slo_class=self.slo.name,
                                    counters=counters)
        except (RedisError, OSError) as e:
            log.warning("cannot write request record %s: %s", self.request_id, e)

    async def received(self) -> None:
        await self._write({"id": self.request_id, "slo_class": self.slo.name, "status": "queued",
                           "api_key": self.api_key, "model": self.model, "created": time.time()})

    async def routed(self, worker: str, admitted: Admitted) -> None:
        """Sent to ``worker``; the first time, the request enters ``requests_total`` (and ``in_flight``) and will
        leave ``in_flight`` for exactly one terminal outcome (``finished``)."""
        self.worker, self.attempts = worker, self.attempts + 1
        self.waited_s = admitted.waited_s + (self.waited_s or 0.0)
        if self.attempts > 1:
            self.metrics.retries.labels(self.slo.name).inc()
        else:  # counted before the write: a cancel during it must not leave the request uncounted
            self.metrics.requests.labels(self.slo.name).inc()
            self.metrics.in_flight.labels(self.slo.name).inc()
        await self._write({"worker": worker, "attempts": self.attempts, "status": "running",
                           "queued": admitted.queued, "queue_ms": _round(1e3 * admitted.waited_s),
                           "admission": admitted.mode, "slack": _round(admitted.choice.slack)},
                          {"requests": 1} if self.attempts == 1 else {"retries": 1})

    async def refused(self, status: str, reason: str) -> None:
        """Never reached a worker: shed, rate limited, no worker. One that did (``attempts``) is already in
        ``requests_total``: refused now, it ends there as failed."""
        if self.attempts:
            await self.finished("failed", None, reason=reason)
            return
        self.ended = True
        if status == "shed":
            self.metrics.shed.labels(self.slo.name, reason).inc()
        await self._write({"status": status, "reason": reason}, {status: 1})

    def on_tokens(self, n: int) -> None:
        if n <= 0:
            return
        now = time.monotonic()
        if self.first_s is None:
            self.first_s = now
        self.last_s = now
        self.tokens += n
        self.metrics.output_tokens.labels(self.slo.name).inc(n)

    @property
    def ttft_ms(self) -> float | None:
        return ttft_ms(self.arrival, self.first_s)

    @property
    def tpot_ms(self) -> float | None:
        return mean_tpot_ms(self.first_s, self.last_s, self.tokens)

    async def finished(self, outcome: str, finish: str | None, *, reason: str | None = None) -> bool:
        """``outcome``: done | aborted (client left) | failed | rejected (the worker refused it: a 4xx). Returns
        whether the SLO was met. Once per request; a request never sent (the client left while it waited) only
        gets its record closed, as it was never in ``requests_total``."""
        if self.ended:
            return False
        self.ended = True
        if self.attempts == 0:
            await self._write({"status": outcome, "reason": reason, "ended": time.time()})
            return False
        met = outcome == "done" and slo_met(finish, tpot_ms=self.tpot_ms, ttft_ms=self.ttft_ms,
                                            tpot_target_ms=self.slo.tpot_ms, ttft_target_ms=self.slo.ttft_ms)
        name = self.slo.name
        self.metrics.finished.labels(name, outcome).inc()
        self.metrics.in_flight.labels(name).dec()
        if self.ttft_ms is not None:
            self.metrics.ttft.labels(name).observe(self.ttft_ms / 1e3)
        if self.tpot_ms is not None:
            self.metrics.tpot.labels(name).observe(self.tpot_ms / 1e3)
        if outcome == "done":
            self.metrics.on_slo(name, met=met, tokens=self.tokens)
        counters = {"finished": 1, "tokens": self.tokens, outcome: 1}
        if met:
            counters["slo_met"] = 1
        lesson = self.lesson
        await self._write({"status": outcome, "reason": reason, "finish_reason": finish, "tokens": self.tokens,
                           "ttft_ms": _round(self.ttft_ms), "tpot_ms": _round(self.tpot_ms), "slo_met": met,
                           "predicted_tpot_ms": _round(lesson.predicted_ms) if lesson else None,
                           "decoding_load": _round(lesson.load) if lesson else None,
                           "correction": _round(lesson.before) if lesson else None, "ended": time.time()}, counters)
        return met


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 3)
