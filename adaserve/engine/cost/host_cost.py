"""What an iteration costs outside the model forwards: the engine's own host time, learnt from its iterations.

The cost model (timing.py) predicts forwards. An iteration also spends host time around them: drafting's
planning and top-k, selection, the verification walk, bookkeeping. On a GPU that is a fraction of a
millisecond; on a fast CPU serving the demo pair it is as long as the target's forward (issue 30's
microbench: ~3 ms per speculative iteration at one request, ~0.6 ms plain, against a ~1.6 ms target forward).
A shape rule that prices only the forwards then sees every depth cheaper than it is, by a fixed amount, and
so favours shallow trees, each of which pays the fixed host time again for fewer tokens. The engine learns
and prices it only with ``EngineConfig.host_cost`` (off by default: on an AVX2 CPU, where the host time is a
small share, it tied with the forwards alone; docs/benchmarks.md).

``HostCost`` keeps the latest decode-only iterations' host seconds (wall minus forwards, ``StepMetrics``) and
fits, by least squares, one line for speculative iterations and one for plain ones:

    host(d, n) = a_spec + b_spec * d + c_spec * n      d >= 1 draft levels, n decoding requests
    host(0, n) = a_plain + c_plain * n

fitted about the window's means (so a column the window never varied, every iteration at one depth say, gets
slope 0 and the line stays flat along it, instead of least squares sharing the mean out over intercept and
slope), slopes at least 0 (more levels or requests never cost less host time). Until a kind has
``MIN_SAMPLES`` iterations its prediction is 0 (the forwards alone, as before); a prediction below 0 is 0.

May import: numpy only.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np

WINDOW = 256  # iterations of each kind kept
MIN_SAMPLES = 8  # iterations of a kind before its line is used
REFIT_EVERY = 16  # observations between refits (a refit is a 3-column lstsq over the window)


@dataclass
class HostCost:
    """Host seconds per iteration as a line in (depth, requests), one for plain and one for speculative
    iterations (module docstring)."""

    window: int = WINDOW
    min_samples: int = MIN_SAMPLES
    refit_every: int = REFIT_EVERY
    # rows (depth, requests, seconds) per kind: 0 speculative, 1 plain; their fitted (a, b, c); observations since
    _rows: tuple[deque[tuple[int, int, float]], ...] = field(default_factory=lambda: (deque(), deque()))
    _coef: list[np.ndarray | None] = field(default_factory=lambda: [None, None])
    _since: list[int] = field(default_factory=lambda: [0, 0])

    def observe(self, depth: int, n: int, host_s: float) -> None:
        """One decode-only iteration: the depth it drafted (0: plain), its decoding requests, its host seconds."""
        if n < 1 or not np.isfinite(host_s):
            return
        kind = 0 if depth > 0 else 1
        rows = self._rows[kind]
        rows.append((depth, n, max(0.0, host_s)))
        if len(rows) > self.window:
            rows.popleft()
        self._since[kind] += 1
        if len(rows) >= self.min_samples and (self._coef[kind] is None or self._since[kind] >= self.refit_every):
            self._coef[kind] = _fit(np.asarray(rows, np.float64))
            self._since[kind] = 0

    def predict(self, depth: int, n: int) -> float:
        """Host seconds of an iteration drafting ``depth`` levels (0: plain) for ``n`` requests; 0 until learnt."""
        c = self._coef[0 if depth > 0 else 1]
        return 0.0 if c is None else max(0.0, float(c[0] + c[1] * depth + c[2] * n))


def _fit(rows: np.ndarray) -> np.ndarray:
    """(a, b, c) of ``host = a + b d + c n`` over rows (d, n, host): least squares about the means, slopes >= 0.

        (b, c) = lstsq([d - mean d, n - mean n], host - mean host)   a column without variance gets 0
        a      = mean host - b mean d - c mean n
    """
    mean = rows.mean(axis=0)
    centred = rows - mean
    slopes = np.linalg.lstsq(centred[:, :2], centred[:, 2], rcond=None)[0]
    slopes = np.maximum(slopes, 0.0)
    return np.array([mean[2] - slopes[0] * mean[0] - slopes[1] * mean[1], slopes[0], slopes[1]])
