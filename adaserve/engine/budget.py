"""Choosing the token budget B: the knee of the measured roofline.

``t(n)`` is the latency of one target forward over ``n`` new tokens at a fixed context (AdaServe section 3;
docs/architecture.md §8). While the forward is memory-bound ``t`` stays flat at
``t(1)`` (every token reuses the same weight load); past the roofline ridge it grows ~linearly in ``n``.
B is the knee: the most tokens one forward can carry for (almost) the price of one, see
:func:`choose_budget`.

Pure logic: no model, no device, no clock. The profiler (profiler.py) times the forwards and hands the
numbers in here. Runtime dependencies: numpy and the standard library only.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from adaserve.engine.checks import is_int, is_real
from adaserve.engine.config import KneeConfig

__all__ = ["RooflinePoint", "choose_budget", "robust_latency", "smooth_roofline"]


# ---- repeated timings -> one point of the roofline ---------------------------------------------


def robust_latency(samples: Sequence[float]) -> float:
    """One latency from repeated timings of the same forward: their median.

    Why the median: timing noise on a GPU is one-sided and heavy-tailed (a stray kernel from another
    process, a host hiccup before the sync, clock ramp-up): a few samples land far to the right, almost
    none to the left. The mean is dragged by those; a trimmed mean needs a trim fraction that suits the
    sample count (5 samples cannot lose 20% from each side gracefully); the minimum is biased low (boost
    clocks). The median ignores up to half the samples being outliers and needs no tuning. Its cost, a
    little more variance than the mean on clean Gaussian noise, is irrelevant next to eps ~ 10%.
    """
    arr = np.asarray(list(samples), dtype=np.float64)
    if arr.ndim != 1 or arr.size == 0:
        raise ValueError("robust_latency needs a non-empty 1-D sequence of latencies")
    if not np.all(np.isfinite(arr)):
        raise ValueError("latency samples must be finite (a NaN/inf timing means the measurement failed)")
    if np.any(arr < 0):
        raise ValueError("latency samples must be non-negative")
    return float(np.median(arr))


# ---- the knee ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RooflinePoint:
    """Measured latency of one forward over ``n_tokens`` new tokens (seconds, e.g. a robust_latency)."""

    n_tokens: int
    latency_s: float

    def __post_init__(self) -> None:
        if not is_int(self.n_tokens) or self.n_tokens < 1:
            raise ValueError(f"n_tokens must be an int >= 1, got {self.n_tokens!r}")
        if not is_real(self.latency_s) or not math.isfinite(self.latency_s) or self.latency_s <= 0:
            raise ValueError(f"latency_s must be a finite number > 0, got {self.latency_s!r}")


def _sorted_curve(points: Sequence[RooflinePoint]) -> tuple[np.ndarray, np.ndarray]:
    pts = list(points)
    if not pts:
        raise ValueError("choose_budget needs at least one roofline point")
    for p in pts:
        if not isinstance(p, RooflinePoint):
            raise ValueError(f"expected RooflinePoint, got {type(p).__name__}")
    pts.sort(key=lambda p: p.n_tokens)
    n = np.array([p.n_tokens for p in pts], dtype=np.int64)
    if np.any(np.diff(n) == 0):
        raise ValueError("duplicate n_tokens in roofline points: aggregate repeats with robust_latency first")
    return n, np.array([p.latency_s for p in pts], dtype=np.float64)


def _median3(t: np.ndarray) -> np.ndarray:
    """Running median of 3 with Tukey's end-point rule.

    Interior: s[i] = median(t[i-1], t[i], t[i+1]).
    First point (Tukey): s[0] = median(t[0], s[1], 3 s[1] - 2 s[2]): the value extrapolated linearly from
    the two smoothed neighbours gets a vote. This matters because s[0] ~ t(1) is the threshold's
    reference: a lone spike or dip there is voted out (so is a special fast n=1 kernel, e.g. a GEMV path
    faster than the plateau), which replicating the end point would not do. A curve rising from n=1 on
    (knee at 1) extrapolates below t[0] and keeps t[0].
    Last point: kept as measured. A rise seen only at the largest probe is indistinguishable from a
    spike; keeping it errs on the small-budget side (and the end rule would flatten a real knee at the
    second-to-last probe).
    """
    m = t.size
    if m < 3:
        return t.copy()
    s = t.copy()
    s[1:-1] = np.median(np.stack([t[:-2], t[1:-1], t[2:]]), axis=0)
    s[0] = float(np.median([t[0], s[1], 3.0 * s[1] - 2.0 * s[2]]))
    return s


def smooth_roofline(points: Sequence[RooflinePoint], *, smooth: bool = True) -> list[RooflinePoint]:
    """The curve the knee is read from: median-of-3 filtered (optional), then made non-decreasing.

    1. median-of-3 (Tukey's rule at the first probe): removes any isolated single-point outlier, spike
       or dip. A lone spike in the flat region would otherwise end the search early, a lone dip past the
       knee extend it.
    2. monotone envelope m(n) = max_{n' <= n} s(n') (cumulative max). More tokens never make a forward
       cheaper, so a decrease is noise; taking the running max means that once the curve has crossed the
       threshold no later (noisy-low) point can bring it back under. "Largest n with m(n) <= thr" then
       equals "every measured n' <= n stays under thr" (the curve must stay under the threshold all the
       way up to B, not merely touch it again further out).

    Why not isotonic regression (PAVA)? Least-squares PAVA pools a spike with its right neighbours and
    lifts the whole block above the threshold (a 2x spike needs ~10 flat points to dilute under eps=10%);
    the L1 variant's tie rule biases it to either spikes or dips. Median-3 + cumulative max has a simple
    guarantee: a single outlier at grid index i only changes s at i-1..i+1 (and s[0], which reads
    t[0..3]), so with the knee at grid index k >= 1 it moves B by at most one grid step, and not at all
    when i <= k - 2 (spikes, n=1 included) or i >= k + 3 (dips). Two adjacent bad probes are taken at
    face value: re-measure with more samples per point rather than smooth harder.
    """
    n, t = _sorted_curve(points)
    s = _median3(t) if smooth else t
    m = np.maximum.accumulate(s)
    return [RooflinePoint(int(k), float(v)) for k, v in zip(n, m, strict=True)]


def choose_budget(points: Sequence[RooflinePoint], cfg: KneeConfig | None = None) -> int:
    """The hardware budget B (tokens per forward) from a measured roofline.

    ``points``: one :class:`RooflinePoint` per probed n (any order, no duplicates), typically n in
    {1, 2, 4, ..., 1024}. The reference t(1) is the smoothed latency at the smallest probed n (probe n=1).

    Elasticity criterion (default): with m the smoothed monotone curve, the slopes
        e_i = log(m(n_{i+1}) / m(n_i)) / log(n_{i+1} / n_i)
    are read left to right and B is the n where the first slope above ``max_elasticity`` starts. On a
    GPU's flat-then-linear roofline the slope jumps from ~0 to ~1 at the ridge, so B is the ridge; on a
    CPU, whose forward is a fixed cost plus a per-token cost (t = a + b n, no flat part), B lands near
    n = a / b, where the per-token part overtakes the fixed part. The latency criterion below would
    give B = 1 on such a curve, since t(2) is already more than 10% above t(1).

    Latency criterion: with m the smoothed monotone curve (:func:`smooth_roofline`),
        B = max{ n : m(n) <= (1 + eps) * m(n_min) }.
    Because m is non-decreasing, this is the last n before the curve first crosses the threshold.

    Throughput criterion: tokens/s g(n) = n / m(n) over the admissible set
        A = { n : m(n) <= (1 + eps_max) * m(n_min) },
    B = min{ n in A : g(n) >= (1 - throughput_tol) * max_A g }.

    Trade-off. The latency knee bounds what speculation may cost every request in the batch: no forward
    is more than eps slower than plain decoding, which is what AdaServe's budget means (the most tokens
    per pass before the pass gets slower) and what tight TPOT SLOs need. The throughput criterion admits a
    larger B when the transition past the ridge is gradual (tokens/s still rising though t(n) is), buying
    throughput with up to eps_max extra latency per iteration; on an ideal flat-then-linear roofline both
    give the ridge point since tokens/s is flat beyond it.

    B is always a probed n, >= the smallest one. The threshold crossing lies between B and the next probe
    (2B on a power-of-two grid): refine the grid there if a finer B matters.
    """
    cfg = KneeConfig() if cfg is None else cfg
    if not isinstance(cfg, KneeConfig):
        raise ValueError(f"cfg must be a KneeConfig, got {type(cfg).__name__}")
    curve = smooth_roofline(points, smooth=cfg.smooth)
    n = np.array([p.n_tokens for p in curve], dtype=np.int64)
    m = np.array([p.latency_s for p in curve], dtype=np.float64)
    t_ref = m[0]
    if cfg.criterion == "elasticity":
        # slope of each grid step in log-log space; m is non-decreasing so slopes are >= 0
        slopes = np.diff(np.log(m)) / np.diff(np.log(n.astype(np.float64)))
        steep = np.nonzero(slopes > cfg.max_elasticity)[0]
        return int(n[steep[0]] if steep.size else n[-1])
    if cfg.criterion == "latency":
        # m is non-decreasing, so the admissible set is a prefix of the grid.
        ok = m <= (1.0 + cfg.eps) * t_ref
        return int(n[ok][-1])
    ok = m <= (1.0 + cfg.eps_max) * t_ref
    n_ok, g = n[ok], n[ok] / m[ok]  # tokens per second on the admissible prefix
    good = g >= (1.0 - cfg.throughput_tol) * g.max()
    return int(n_ok[good][0])
