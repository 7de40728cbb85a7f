"""Choosing the token budget B: the knee of the measured roofline.

``t(n)`` is the latency of one target forward over ``n`` new tokens at a fixed context (AdaServe section 3;
docs/architecture.md §8). While the forward is memory-bound ``t`` stays flat at
``t(1)`` (every token reuses the same weight load); past the roofline ridge it grows ~linearly in ``n``.
B is the knee: the most tokens one forward can carry for (almost) the price of one, see
:func:`choose_budget`.

Before a table is trusted, :func:`check_roofline` asks whether it can be a roofline at all (a busy
machine once produced one that chose B = 2 and stopped speculation for every later start), and
``speculation.adaptive.speculation_floor`` is the least B the engine may run with, whatever the
table says.

Pure logic: no model, no device, no clock. The profiler (profiler.py) times the forwards and hands the
numbers in here. Runtime dependencies: numpy and the standard library only.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

from adaserve.engine.checks import is_int, is_real

__all__ = [
    "KneeConfig",
    "RooflinePoint",
    "TableCheck",
    "TableVerdict",
    "check_roofline",
    "choose_budget",
    "relative_spread",
    "reproducible_dip",
    "robust_latency",
    "smooth_roofline",
]


@dataclass(frozen=True)
class KneeConfig:
    """How budget.choose_budget reads the roofline.

    criterion="elasticity" (default): B = the last n before the first grid step whose log-log slope
    d log t / d log n exceeds ``max_elasticity``: past it, doubling the tokens per forward costs more
    than a sqrt(2) rise in latency, i.e. the forward has stopped being mostly fixed cost.
    criterion="latency": B = largest n with t(n) <= (1 + eps) * t(1).
    criterion="throughput": B = the n maximising n / t(n) subject to t(n) <= (1 + eps_max) * t(1); among n
    whose tokens/s is within ``throughput_tol`` (relative) of that maximum, the smallest is taken, since a
    roofline past its ridge has a flat tokens/s plateau on which more tokens only cost latency.
    smooth: apply the median-of-3 outlier filter (see budget.smooth_roofline); the monotone envelope is
    always applied.
    """

    eps: float = 0.1
    criterion: Literal["elasticity", "latency", "throughput"] = "elasticity"
    max_elasticity: float = 0.5
    eps_max: float = 0.5
    throughput_tol: float = 0.02
    smooth: bool = True

    def __post_init__(self) -> None:
        for name in ("eps", "eps_max", "throughput_tol", "max_elasticity"):
            v = getattr(self, name)
            if not is_real(v) or not math.isfinite(v) or v < 0:
                raise ValueError(f"KneeConfig.{name} must be a finite number >= 0, got {v!r}")
        if self.throughput_tol >= 1:
            raise ValueError(f"KneeConfig.throughput_tol must be < 1, got {self.throughput_tol!r}")
        if self.criterion not in ("elasticity", "latency", "throughput"):
            raise ValueError(
                f"KneeConfig.criterion must be 'elasticity', 'latency' or 'throughput': {self.criterion!r}")
        if not isinstance(self.smooth, bool):
            raise ValueError(f"KneeConfig.smooth must be a bool, got {self.smooth!r}")


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


# ---- is a measured table a roofline at all? -------------------------------------------------------


@dataclass(frozen=True)
class TableCheck:
    """What a measured table must satisfy before its knee is trusted and cached (:func:`check_roofline`).

    max_drop: a probe may lie at most this fraction below the slowest smaller probe. More tokens never
        make a forward cheaper; on a quiet machine the medians of interleaved rounds wobble by a few %.
    max_exponent: from one probe to the next, t may grow at most like n^max_exponent (1.5: 2.8x per
        doubling). A forward over 2n tokens costs at most about two forwards over n, whether t = a + b n
        (a CPU) or flat then linear (a GPU), so a steeper step is a stall, not the hardware.
    max_spread: the median absolute deviation of one probe's rounds may be at most this fraction of
        their median (:func:`relative_spread`): a median is only as good as most rounds agree.
    noise_floor_s: differences below this are timer noise whatever the ratios say (1 ms forwards).
    dip_tokens, max_dip: a drop deeper than max_drop is still physical when the rounds show it is no
        accident (:func:`reproducible_dip`) and it lies among forwards of at most ``dip_tokens`` new tokens,
        at most ``max_dip`` deep: for a few rows the kernel is chosen per row count (few_rows.py on a CPU,
        GEMV against GEMM on a GPU), and on this CPU t(n=2) is reproducibly 25-40% below t(n=1) at
        context 64. A dip past ``dip_tokens``, a deeper one, or one the rounds do not all show is noise.
    """

    max_drop: float = 0.15
    max_exponent: float = 1.5
    max_spread: float = 0.25
    noise_floor_s: float = 2e-4
    dip_tokens: int = 16
    max_dip: float = 0.5

    def __post_init__(self) -> None:
        for name in ("max_drop", "max_exponent", "max_spread", "noise_floor_s"):
            v = getattr(self, name)
            if not is_real(v) or math.isnan(v) or v < 0:
                raise ValueError(f"TableCheck.{name} must be a number >= 0, got {v!r}")
        if self.max_drop >= 1:
            raise ValueError(f"TableCheck.max_drop must be < 1, got {self.max_drop!r}")
        if not is_real(self.max_dip) or not 0 <= self.max_dip < 1:
            raise ValueError(f"TableCheck.max_dip must be in [0, 1), got {self.max_dip!r}")
        if not is_int(self.dip_tokens) or self.dip_tokens < 0:
            raise ValueError(f"TableCheck.dip_tokens must be an int >= 0, got {self.dip_tokens!r}")
        if self.max_exponent < 1:
            raise ValueError(f"TableCheck.max_exponent must be >= 1 (linear growth is physical), "
                             f"got {self.max_exponent!r}")


@dataclass(frozen=True)
class TableVerdict:
    """What :func:`check_roofline` found: nothing (ok), or one sentence per implausible probe."""

    problems: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        return not self.problems

    def reason(self, limit: int = 3) -> str:
        """The first ``limit`` problems, for a log line."""
        if self.ok:
            return "ok"
        more = len(self.problems) - limit
        return "; ".join(self.problems[:limit]) + (f"; and {more} more" if more > 0 else "")


def _median_and_mad(samples: Sequence[float]) -> tuple[float, float]:
    arr = np.asarray(list(samples), dtype=np.float64)
    med = float(np.median(arr))
    return med, float(np.median(np.abs(arr - med)))


def relative_spread(samples: Sequence[float]) -> float:
    """MAD / median of one probe's rounds, MAD = median_i |x_i - median|: how far the rounds disagree.

    Like the median itself it ignores any minority of outliers (2 stalled rounds of 5), so it flags a
    probe exactly when its median cannot be trusted either: most rounds disagree.
    """
    med, mad = _median_and_mad(samples)
    return mad / med if med > 0 else math.inf


def _ms(t: float) -> str:
    return f"{1e3 * t:.1f} ms"


MIN_DIP_ROUNDS = 3  # fewer rounds cannot show that a dip repeats


def reproducible_dip(fast: Sequence[float], slow: Sequence[float]) -> bool:
    """Did (almost) every round see the ``fast`` probe cheaper than the ``slow`` one (rounds paired by index)?

    The profiler times every probe once per round, each round in its own shuffled order
    (profiler.measure_interleaved), so round r of two probes shared the machine's state of round r. A
    dip that a busy spell wrote lands in a round or two and is outvoted here; a different kernel for
    fewer rows is cheaper in every round. One dissenting round in five (a stall of the fast probe) is
    allowed; at least MIN_DIP_ROUNDS rounds are needed to tell the two apart.
    """
    xs, ys = list(fast), list(slow)
    if len(xs) != len(ys) or len(xs) < MIN_DIP_ROUNDS:
        return False
    wins = sum(x < y for x, y in zip(xs, ys, strict=True))
    return wins >= len(xs) - len(xs) // 5


def _tolerated_dip(n_fast: int, n_slow: int, depth: float, samples: Mapping[int, Sequence[float]] | None,
                   check: TableCheck) -> bool:
    if samples is None or n_fast not in samples or n_slow not in samples:
        return False
    return (n_fast <= check.dip_tokens and depth <= check.max_dip
            and reproducible_dip(samples[n_fast], samples[n_slow]))


def _shape_problems(n: np.ndarray, t: np.ndarray, check: TableCheck,
                    samples: Mapping[int, Sequence[float]] | None = None) -> list[str]:
    """Drops below the slowest smaller probe, and rises steeper than n^max_exponent between neighbours.

    With ``samples`` (the rounds), a drop among few rows that every round shows is a kernel, not noise
    (:class:`TableCheck` dip_tokens): it is not a problem.
    """
    out = []
    for i in range(1, n.size):
        j = int(np.argmax(t[:i]))  # the slowest smaller probe
        # drop: t_i < (1 - max_drop) * max_{j<i} t_j
        if t[i] < (1.0 - check.max_drop) * t[j] - check.noise_floor_s:
            depth = 1 - t[i] / t[j]
            if not _tolerated_dip(int(n[i]), int(n[j]), depth, samples, check):
                out.append(f"t(n={n[i]}) = {_ms(t[i])} is {depth:.0%} below t(n={n[j]}) = {_ms(t[j])}: "
                           "more tokens cannot make a forward cheaper")
        # rise: t_i / t_{i-1} > (n_i / n_{i-1})^max_exponent
        allowed = float(n[i] / n[i - 1]) ** check.max_exponent
        if t[i] > allowed * t[i - 1] + check.noise_floor_s:
            out.append(f"t(n={n[i]}) = {_ms(t[i])} is {t[i] / t[i - 1]:.1f}x t(n={n[i - 1]}) = {_ms(t[i - 1])}: "
                       f"at most {allowed:.1f}x is physical")
    return out


def _spread_problems(samples: Mapping[int, Sequence[float]], check: TableCheck) -> list[str]:
    out = []
    for n in sorted(samples):
        xs = list(samples[n])
        if len(xs) < 2:
            continue
        med, mad = _median_and_mad(xs)
        if mad > check.max_spread * med + check.noise_floor_s:
            out.append(f"t(n={n}) rounds disagree: typically {_ms(mad)} from their median {_ms(med)} "
                       f"(at most {check.max_spread:.0%})")
    return out


def check_roofline(points: Sequence[RooflinePoint], samples: Mapping[int, Sequence[float]] | None = None,
                   check: TableCheck | None = None) -> TableVerdict:
    """Can ``points`` (one robust latency per n) be a measured roofline, or did a busy machine write it?

    Shape (always): no probe far below a smaller one, no step steeper than n^max_exponent (see
    :class:`TableCheck`). Spread (when ``samples``, n -> the rounds' seconds, is given): the rounds of
    each probe agree; and a drop among few rows that every round shows (a faster kernel for that row
    count) is allowed, where without the rounds it is refused. The knee of a table that fails means
    nothing: re-measure it, and do not cache it.
    """
    check = TableCheck() if check is None else check
    n, t = _sorted_curve(points)
    problems = _shape_problems(n, t, check, samples)
    if samples is not None:
        problems += _spread_problems(samples, check)
    return TableVerdict(tuple(problems))
