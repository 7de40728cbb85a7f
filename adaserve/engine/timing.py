"""Predicting how long a forward takes: the cost model when profiled, else one learnt online.

SmartSpec's model ``T_fwd = alpha*N_context + gamma*N_batched + delta`` (cost_model.py) is what
the start-up profiler fits. Until a worker has profiled, the engine refits it every few steps from
its own measured forwards, starting from a flat guess, so A(r) and SmartSpec always have a number.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field

from adaserve.engine.cost_model import CostModel, fit_cost_model

log = logging.getLogger(__name__)


@dataclass
class OnlineCostModel:
    """A cost model that starts from ``initial`` and, unless ``frozen``, refits from recent samples."""

    initial: CostModel
    frozen: bool = False
    window: int = 256
    refit_every: int = 16
    samples: deque[tuple[int, int, float]] = field(default_factory=deque)
    _model: CostModel | None = None
    _since_fit: int = 0

    @property
    def model(self) -> CostModel:
        return self._model or self.initial

    def predict(self, n_context: int, n_batched: int) -> float:
        return self.model.predict(max(0, n_context), max(0, n_batched))

    def observe(self, n_context: int, n_batched: int, seconds: float) -> None:
        if self.frozen or seconds <= 0:
            return
        self.samples.append((n_context, n_batched, seconds))
        while len(self.samples) > self.window:
            self.samples.popleft()
        self._since_fit += 1
        if self._since_fit >= self.refit_every and len(self.samples) >= 8:
            self._since_fit = 0
            try:
                self._model, _ = fit_cost_model(list(self.samples))
            except ValueError:  # not enough variation in the samples yet to separate the terms
                log.debug("cost model refit skipped: samples do not separate context and batch terms")
