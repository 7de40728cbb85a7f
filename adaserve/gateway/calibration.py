"""Predicted against observed: the correction k_w the gateway learns per worker from its own finished requests.

When a request ends, routing.py predicts the TPOT it should have had on its worker at the mean number of
requests the worker held while it decoded; the correction moves towards observed / predicted:

    log k  <-  (1 - RATE) * log k + RATE * log(observed / predicted),   k within [1/LIMIT, LIMIT]

An exponentially weighted mean in log space, so a request twice as slow as predicted weighs as much as one
twice as fast; bounded, so one stalled request (a machine busy with something else) cannot switch a worker
off for good. Requests with fewer than ``MIN_TOKENS`` tokens say too little about per-token time to count.

It also keeps, per class, the time its last ``TTFT_WINDOW`` requests took from admission to their first token
(their TTFT less their wait): the ``TTFT_QUANTILE`` of those is what a waiting request of the class should
expect once admitted, so a class with a TTFT target waits only what is left of its target after that.
Measured here, from this gateway's own requests, it reflects its own admission, not another client's traffic.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

RATE = 0.2
LIMIT = 4.0
MIN_TOKENS = 8
TTFT_WINDOW = 16  # a class's last admitted requests whose TTFT after admission is kept
TTFT_QUANTILE = 0.75


def learn(correction: float, predicted_ms: float, observed_ms: float, *, rate: float = RATE,
          limit: float = LIMIT) -> float:
    """The correction after one request that was predicted ``predicted_ms`` per token and got ``observed_ms``."""
    if not (predicted_ms > 0 and observed_ms > 0 and math.isfinite(predicted_ms) and math.isfinite(observed_ms)):
        return correction
    log_k = (1.0 - rate) * math.log(correction) + rate * math.log(observed_ms / predicted_ms)
    return min(max(math.exp(log_k), 1.0 / limit), limit)


@dataclass
class Calibration:
    """Each worker's correction (1 until its first observation) and how many observations made it."""

    rate: float = RATE
    limit: float = LIMIT
    min_tokens: int = MIN_TOKENS
    corrections: dict[str, float] = field(default_factory=dict)
    observations: dict[str, int] = field(default_factory=dict)
    after_admission: dict[str, deque[float]] = field(default_factory=dict)  # class -> ms to the first token

    def correction(self, worker_id: str) -> float:
        return self.corrections.get(worker_id, 1.0)

    def observe(self, worker_id: str, *, predicted_ms: float | None, observed_ms: float | None,
                tokens: int) -> float:
        """Learn from one finished request; returns the worker's correction after it."""
        if predicted_ms is None or observed_ms is None or tokens < self.min_tokens:
            return self.correction(worker_id)
        k = learn(self.correction(worker_id), predicted_ms, observed_ms, rate=self.rate, limit=self.limit)
        self.corrections[worker_id] = k
        self.observations[worker_id] = self.observations.get(worker_id, 0) + 1
        return k

    def observe_ttft(self, slo_class: str, after_admission_ms: float | None) -> None:
        if after_admission_ms is not None and after_admission_ms >= 0 and math.isfinite(after_admission_ms):
            self.after_admission.setdefault(slo_class, deque(maxlen=TTFT_WINDOW)).append(after_admission_ms)

    def ttft_after_admission_ms(self, slo_class: str) -> float | None:
        """What a request of the class should expect from admission to its first token; None before any."""
        seen = sorted(self.after_admission.get(slo_class, ()))
        return seen[min(len(seen) - 1, int(TTFT_QUANTILE * len(seen)))] if seen else None
