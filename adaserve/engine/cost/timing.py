"""Predicting how long a forward takes: the profiled cost model, corrected by the forwards the engine times.

SmartSpec's model ``T_fwd = alpha*N_context + gamma*N_batched + delta`` (with the attention cells' beta*N_cells,
cost_model.py) is what the start-up profiler fits. A profile can be wrong (measured while the machine was busy, or
on a machine that has since become busier or quieter), and nothing would ever notice: so the engine hands every
forward it times to :class:`OnlineCostModel`, which keeps the predictions honest (docs/architecture.md §8).
Without a profile it refits from those forwards, starting from a flat guess, so A(r) and SmartSpec always
have a number.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from adaserve.engine.cost.cost_model import CostModel, even_cells, fit_model, predict_columns
from adaserve.engine.model.runner import chunk_cells

log = logging.getLogger(__name__)

# (n_context, n_batched, seconds, n_cells); a sample without its cells has one new token a sequence (cells = context)
Sample = tuple[int, int, float, float]
SampleIn = Sample | tuple[int, int, float]


@dataclass(frozen=True)
class PromptLoad:
    """The prompt chunks riding in an iteration's target forward beside the decoding requests' trees: their tokens,
    their sequences' cached tokens, and their attention cells (``runner.chunk_cells`` each). A chunk's tokens
    read its own sequence's keys, not the decoding requests' (:meth:`OnlineCostModel.for_batch`)."""

    tokens: int = 0
    context: int = 0
    cells: int = 0

    @classmethod
    def of(cls, chunks: Iterable[tuple[int, int]]) -> PromptLoad:
        """The load of ``(new tokens, cached tokens)`` chunks, one a sequence."""
        tokens = context = cells = 0
        for new, cached in chunks:
            tokens, context, cells = tokens + new, context + cached, cells + chunk_cells(new, cached)
        return cls(tokens, context, cells)


def scaled(model: CostModel, k: float) -> CostModel:
    """k * T_fwd: every coefficient times k (a uniformly faster or slower machine)."""
    return model.scaled(k)


def _columns(samples: Sequence[SampleIn] | np.ndarray) -> np.ndarray:
    """The samples as one float64 ``[n, 4]`` array (context, batched, seconds, cells); the counts are exact.
    Samples of three columns get their context as their cells."""
    a = np.asarray(samples, np.float64)
    if a.size == 0:
        return a.reshape(0, 4)
    if a.ndim == 2 and a.shape[1] == 3:
        a = np.column_stack([a, a[:, 0] + a[:, 1]])
    return a.reshape(-1, 4)


def predict_many(model: CostModel, samples: Sequence[SampleIn] | np.ndarray) -> np.ndarray:
    """``model.predict(c_i, b_i, k_i)`` for every sample at once, bit for bit (the same operations in the same
    order)."""
    a = _columns(samples)
    return predict_columns(model, a[:, 0], a[:, 1], a[:, 3])


def median_ratio(model: CostModel, samples: Sequence[SampleIn] | np.ndarray) -> float | None:
    """median_i(y_i / T(c_i, b_i)): how much slower the forwards ran than ``model`` says (None: no usable sample)."""
    p, y = predict_many(model, samples), _columns(samples)[:, 2]
    ratios = y[p > 0] / p[p > 0]
    return float(np.median(ratios)) if len(ratios) else None


def median_rel_error(model: CostModel, samples: Sequence[SampleIn] | np.ndarray) -> float:
    """median_i |T(c_i, b_i) - y_i| / y_i: a few stalled forwards do not count, a persistent miss does."""
    y = _columns(samples)[:, 2]
    return float(np.median(np.abs(predict_many(model, samples) - y) / y))


class ForwardSplitter:
    """Times each of several consecutive forwards on one clock, each with its own token and context counts.

    :meth:`start` before the first forward, :meth:`__call__` (n_context, n_new, n_cells) right after each one,
    :meth:`finish` when the last one's caller is done: forward k's seconds run from the end of forward
    k-1 (or the start) to its own end, and the time after the last forward goes to the last one. So the
    samples add up to the whole span, and each forward carries the host work that prepared it (on a
    simulated clock that work costs nothing and each sample is exactly that forward's price).

    Why not the span divided by the number of forwards: the draft's beam search runs every request's
    catch-up tokens (accepted last iteration, unseen by the draft) in its first forward and n * w beam
    nodes in each later one. Dividing the span by the depth and calling each part an n * w forward made
    the draft look 1.2-1.9x dearer per beam step than its profile in the simulated clock, and the online
    correction rescaled a correct draft cost model by that much (docs/architecture.md §8).
    """

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self.samples: list[Sample] = []
        self._last = 0.0

    def start(self) -> None:
        self.samples = []
        self._last = self.clock()

    def __call__(self, n_context: int, n_new: int, n_cells: float | None = None) -> None:
        now = self.clock()
        self.samples.append((n_context, n_new, now - self._last, n_context + n_new if n_cells is None else n_cells))
        self._last = now

    def finish(self) -> list[Sample]:
        """The samples, the time since the last forward added to it."""
        now = self.clock()
        if self.samples:
            c, b, y, k = self.samples[-1]
            self.samples[-1] = (c, b, y + (now - self._last), k)
        self._last = now
        return list(self.samples)


@dataclass
class OnlineCostModel:
    """A cost model that starts from ``initial`` and follows the forwards handed to :meth:`observe`.

    Every ``refit_every`` samples (once ``min_samples`` are in the window of the last ``window``); the
    least-squares refit, the dear part (~1.5 ms of host time on a CPU), only once the samples since the
    last refit are a quarter of the window's (at least ``refit_every``: every 64 of a full 256), or while no
    refit has succeeded yet (issue 30). In between, an unprofiled model keeps its last refit, and a profiled
    one that misses weighs its scaled profile against its last refit:

    - unprofiled (``frozen=False``): refit T_fwd on the window (cost_model.fit_cost_model); until the
      window separates the context and batch terms, scale the flat guess instead (below).
    - profiled (``frozen=True``): the profile's shape is trusted, its scale is not. With
          k = median_i(y_i / T_profile(c_i, b_i))
      predictions become k * T_profile when the profile persistently disagrees with the window,
      |log k| > log(1 + tolerance), with k clamped to [1 / max_correction, max_correction]. A handful of
      stalls cannot move a median; a busy profile (every forward 5x slower than now) can. If even the
      scaled profile misses the window by more than ``tolerance`` (median relative error: the shape is
      wrong, or k hit its clamp) and a refit on the window does better, the refit is used instead. Each
      check starts again from the profile, so the correction returns to 1 when the profile agrees.
    """

    initial: CostModel
    frozen: bool = False
    window: int = 256
    refit_every: int = 16
    min_samples: int = 16
    tolerance: float = 0.2
    max_correction: float = 16.0
    samples: deque[Sample] = field(default_factory=deque)
    _model: CostModel | None = None
    _scale: float = 1.0
    _since_fit: int = 0
    _since_refit: int = 0
    _source: str = "initial"
    # scaled(self._model or self.initial, self._scale), kept by _set: a prediction builds no model
    _current: CostModel | None = field(default=None, compare=False, repr=False)

    @property
    def model(self) -> CostModel:
        """The model predictions come from now (what a worker publishes)."""
        if self._current is None:
            self._current = scaled(self._model or self.initial, self._scale)
        return self._current

    @property
    def correction(self) -> float:
        """The factor applied to the initial model (1: none; a refit replaced it: also 1)."""
        return self._scale

    @property
    def source(self) -> str:
        """'initial', 'scaled' (initial times :attr:`correction`) or 'refit'."""
        return self._source

    def predict(self, n_context: int, n_batched: int, n_cells: float | None = None) -> float:
        # read a dozen times an iteration (issue 30): the clamps without a call each
        return self.model.predict(n_context if n_context > 0 else 0, n_batched if n_batched > 0 else 0,
                                  None if n_cells is None else n_cells if n_cells > 0 else 0)

    def for_batch(self, n_sequences: int, prompt: PromptLoad | None = None) -> Callable[[int, int], float]:
        """``predict`` for a batch of ``n_sequences`` whose new tokens spread evenly over them, each a causal chunk
        (``cost_model.even_cells``): what the policies price shapes with, knowing the batch's tokens and context, not
        each request's. With ``prompt``, the last ``prompt.tokens`` of ``n_batched`` are its chunks, over their own
        sequences' ``prompt.context`` cached tokens and with their own cells: a 256-token chunk spread over the
        decoding requests instead would read their context, 256 times the mean context too many cells."""
        n = n_sequences if n_sequences > 1 else 1
        predict = self.predict
        if prompt is None or prompt.tokens <= 0:
            return lambda n_context, n_batched: predict(n_context, n_batched, even_cells(n_context, n_batched, n))
        p, p_context, p_cells = prompt.tokens, prompt.context, prompt.cells
        return lambda n_context, n_batched: predict(
            n_context + p_context, n_batched, even_cells(n_context, n_batched - p if n_batched > p else 0, n) + p_cells)

    def observe(self, n_context: int, n_batched: int, seconds: float, n_cells: float | None = None) -> None:
        if not math.isfinite(seconds) or seconds <= 0:
            return
        c = n_context if n_context > 0 else 0
        self.samples.append((c, n_batched if n_batched > 0 else 0, seconds,
                             c + n_batched if n_cells is None else n_cells if n_cells > 0 else 0))
        while len(self.samples) > self.window:
            self.samples.popleft()
        self._since_fit += 1
        self._since_refit += 1
        if self._since_fit >= self.refit_every and len(self.samples) >= self.min_samples:
            self._since_fit = 0
            # an unprofiled model between refits keeps its last one: no window to read (issue 30: three checks
            # in four built the window's columns and two medians only to return)
            if self.frozen or self._refit_due():
                self._recalibrate(_columns(self.samples))

    def _refit_due(self) -> bool:
        """A least-squares refit now: none has succeeded yet, or a quarter of the window is new since the last."""
        return self._model is None or self._since_refit >= max(self.refit_every, len(self.samples) // 4)

    # ---- choosing the model --------------------------------------------------------------------

    def _scale_for(self, samples: np.ndarray) -> float:
        """k clamped to [1/max, max], or 1 inside the dead band |log k| <= log(1 + tolerance).

        Once scaling, the band narrows to half the tolerance, so k near its edge does not flip back and forth.
        """
        k = median_ratio(self.initial, samples)
        band = self.tolerance / 2 if self._source == "scaled" else self.tolerance
        if k is None or k <= 0 or abs(math.log(k)) <= math.log1p(band):
            return 1.0
        return min(max(k, 1.0 / self.max_correction), self.max_correction)

    def _refit(self, samples: np.ndarray) -> CostModel | None:
        self._since_refit = 0
        try:
            # keep the profile's knee: forwards served rarely span it, the profiler's grid did; ``observe``
            # has checked every sample, so the columns go in as they are, with no fit report (cost_model.fit_model)
            model = fit_model(samples[:, 0], samples[:, 1], samples[:, 2], cells=samples[:, 3],
                              knee=self.initial.knee or None, akaike=False, last=self._model)
        except ValueError:  # not enough variation in the samples yet to separate the terms
            return None
        return model

    def _recalibrate(self, samples: np.ndarray) -> None:
        if not self.frozen:
            if not self._refit_due():  # unprofiled: the last refit stands until the next is due
                return
            refit = self._refit(samples)
            # any refit beats the flat guess, so the scaled guess's two medians are only read when it fails
            # (issue 30); ``err`` is logged for a profiled model only
            if refit is not None:
                self._set(refit, 1.0, 0.0)
                return
        k = self._scale_for(samples)
        err = median_rel_error(scaled(self.initial, k), samples)
        if self.frozen and err <= self.tolerance:  # the (scaled) profile fits: keep its shape
            self._set(None, k, err)
            return
        # unprofiled, the refit above failed; profiled, a refit only when one is due
        refit = self._refit(samples) if self.frozen and self._refit_due() else None
        # otherwise the better of the scaled initial model and a refit (this one, else the last one)
        refit = refit or self._model
        if refit is not None and median_rel_error(refit, samples) < err:
            self._set(refit, 1.0, err)
        else:
            self._set(None, k, err)

    def _set(self, refit: CostModel | None, k: float, err: float) -> None:
        source = "refit" if refit is not None else "scaled" if k != 1.0 else "initial"
        if self.frozen and source != self._source:  # a profile was overruled or trusted again: say so
            what = {"refit": f"replaced by a refit on measured forwards (scaled, it still missed them by "
                             f"{err:.0%} in the median)",
                    "scaled": f"predictions scaled by {k:.2f} to match the last {len(self.samples)} forwards",
                    "initial": "agrees with measured forwards again"}[source]
            log.warning("profiled cost model: %s", what)
        self._model, self._scale, self._source = refit, k, source
        self._current = scaled(refit or self.initial, k)
