"""Start-up profiler logic: the hardware budget B, the forward-cost model and their on-disk cache.

Pure logic: no model, no device, no clock. The engine times forwards and hands the numbers in here.

* Budget (AdaServe section 3, DESIGN.md section 5). ``t(n)`` is the latency of one target forward over
  ``n`` new tokens at a fixed context. While the forward is memory-bound ``t`` stays flat at ``t(1)``
  (every token reuses the same weight load); past the roofline ridge it grows ~linearly in ``n``. B is the
  knee: the most tokens one forward can carry for (almost) the price of one, see :func:`choose_budget`.
* Cost model (SmartSpec section 4.3): ``T_fwd = alpha * N_context + gamma * N_batched + delta`` with
  alpha the KV-cache read per context token, gamma the compute per batched token and delta the weight
  load; fitted by non-negative least squares in :func:`fit_cost_model`.
* Cache: :class:`ProfileCache` keeps the result per (device, model, dtype, engine version) so a restart
  does not re-profile.

Runtime dependencies: numpy and the standard library only.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import logging
import math
import os
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

logger = logging.getLogger(__name__)

__all__ = [
    "CACHE_DIR_ENV",
    "CostModel",
    "FitReport",
    "KneeConfig",
    "ProfileCache",
    "ProfileKey",
    "RooflinePoint",
    "choose_budget",
    "default_cache_dir",
    "fit_cost_model",
    "robust_latency",
    "smooth_roofline",
]


def _is_int(x: object) -> bool:
    return isinstance(x, int | np.integer) and not isinstance(x, bool | np.bool_)


def _is_real(x: object) -> bool:
    return isinstance(x, int | float | np.integer | np.floating) and not isinstance(x, bool | np.bool_)


# ================================================================================================
# Latency samples
# ================================================================================================


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


# ================================================================================================
# Hardware budget: the knee of the roofline
# ================================================================================================


@dataclass(frozen=True)
class RooflinePoint:
    """Measured latency of one forward over ``n_tokens`` new tokens (seconds, e.g. a robust_latency)."""

    n_tokens: int
    latency_s: float

    def __post_init__(self) -> None:
        if not _is_int(self.n_tokens) or self.n_tokens < 1:
            raise ValueError(f"n_tokens must be an int >= 1, got {self.n_tokens!r}")
        if not _is_real(self.latency_s) or not math.isfinite(self.latency_s) or self.latency_s <= 0:
            raise ValueError(f"latency_s must be a finite number > 0, got {self.latency_s!r}")


@dataclass(frozen=True)
class KneeConfig:
    """How :func:`choose_budget` reads the roofline.

    criterion="elasticity" (default): B = the last n before the first grid step whose log-log slope
    d log t / d log n exceeds ``max_elasticity``: past it, doubling the tokens per forward costs more
    than a sqrt(2) rise in latency, i.e. the forward has stopped being mostly fixed cost.
    criterion="latency": B = largest n with t(n) <= (1 + eps) * t(1).
    criterion="throughput": B = the n maximising n / t(n) subject to t(n) <= (1 + eps_max) * t(1); among n
    whose tokens/s is within ``throughput_tol`` (relative) of that maximum, the smallest is taken, since a
    roofline past its ridge has a flat tokens/s plateau on which more tokens only cost latency.
    smooth: apply the median-of-3 outlier filter (see :func:`smooth_roofline`); the monotone envelope is
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
            if not _is_real(v) or not math.isfinite(v) or v < 0:
                raise ValueError(f"KneeConfig.{name} must be a finite number >= 0, got {v!r}")
        if self.throughput_tol >= 1:
            raise ValueError(f"KneeConfig.throughput_tol must be < 1, got {self.throughput_tol!r}")
        if self.criterion not in ("elasticity", "latency", "throughput"):
            raise ValueError(
                f"KneeConfig.criterion must be 'elasticity', 'latency' or 'throughput': {self.criterion!r}")
        if not isinstance(self.smooth, bool):
            raise ValueError(f"KneeConfig.smooth must be a bool, got {self.smooth!r}")


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


# ================================================================================================
# Cost model: T_fwd = alpha * N_context + gamma * N_batched + delta
# ================================================================================================


@dataclass(frozen=True)
class CostModel:
    """SmartSpec's forward-time model, seconds. alpha: per context token (KV read), gamma: per batched
    token (compute), delta: fixed (weight load, launch). All >= 0."""

    alpha: float
    gamma: float
    delta: float

    def __post_init__(self) -> None:
        for name in ("alpha", "gamma", "delta"):
            v = getattr(self, name)
            if not _is_real(v) or not math.isfinite(v) or v < 0:
                raise ValueError(f"CostModel.{name} must be a finite number >= 0, got {v!r}")

    def predict(self, n_context: int, n_batched: int) -> float:
        """T_fwd in seconds for a forward reading n_context cached tokens and computing n_batched new ones."""
        if n_context < 0 or n_batched < 0:
            raise ValueError(f"token counts must be >= 0, got n_context={n_context}, n_batched={n_batched}")
        return self.alpha * n_context + self.gamma * n_batched + self.delta

    def to_dict(self) -> dict[str, float]:
        return {"alpha": float(self.alpha), "gamma": float(self.gamma), "delta": float(self.delta)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> CostModel:
        if not isinstance(d, Mapping):
            raise ValueError(f"CostModel.from_dict expects a mapping, got {type(d).__name__}")
        missing = {"alpha", "gamma", "delta"} - set(d)
        if missing:
            raise ValueError(f"CostModel.from_dict: missing keys {sorted(missing)}")
        return cls(alpha=d["alpha"], gamma=d["gamma"], delta=d["delta"])


@dataclass(frozen=True)
class FitReport:
    """Quality of a cost-model fit on its own samples. Relative error e_i = |pred_i - y_i| / y_i."""

    n_samples: int
    mean_rel_error: float
    max_rel_error: float
    r2: float

    def to_dict(self) -> dict[str, float | int]:
        return asdict(self)


def _nnls_small(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """argmin_{x >= 0} ||a x - b||_2 for a handful of columns, exactly, by enumerating supports.

    The NNLS optimum x* satisfies the KKT conditions, so on its support P the gradient vanishes: x*_P is
    an unconstrained least-squares solution on the columns P. Solving lstsq for every one of the 2^p
    supports, keeping the non-negative solutions and taking the smallest residual therefore finds x*
    (it is among the candidates, and every candidate is feasible). 2^3 = 8 tiny solves here, no
    iteration, no tolerance to tune; fine for p <= ~10.
    """
    p = a.shape[1]
    best_x, best_r = np.zeros(p), float(b @ b)  # empty support: x = 0
    for k in range(1, p + 1):
        for support in itertools.combinations(range(p), k):
            cols = list(support)
            xs, *_ = np.linalg.lstsq(a[:, cols], b, rcond=None)
            if np.any(xs < 0):
                continue
            x = np.zeros(p)
            x[cols] = xs
            r = a @ x - b
            rr = float(r @ r)
            if rr < best_r * (1 - 1e-12):  # strict: among equal fits keep the smaller support
                best_x, best_r = x, rr
    return best_x


def fit_cost_model(
    samples: Sequence[tuple[int, int, float]],
    *,
    weighting: Literal["relative", "absolute"] = "relative",
) -> tuple[CostModel, FitReport]:
    """Fit (alpha, gamma, delta) >= 0 to (N_context, N_batched, seconds) samples by least squares.

    Model: y_i ~ alpha * c_i + gamma * b_i + delta. Solved as non-negative least squares (a negative
    coefficient is non-physical, and would predict negative or shrinking times off the sampled range).

    weighting="relative" (default) minimises sum ((pred_i - y_i) / y_i)^2: timing noise is roughly
    multiplicative, and the engine needs small forwards predicted as accurately (in %) as large ones.
    weighting="absolute" minimises sum (pred_i - y_i)^2, plain OLS on seconds.

    Columns are scaled to unit max before solving (N_context ~ 1e5 next to 1, conditioning), which
    leaves the sign constraints unchanged. The samples must vary N_context and N_batched independently
    (design matrix of rank 3), otherwise alpha/gamma/delta are not identifiable and ValueError is raised.
    """
    if weighting not in ("relative", "absolute"):
        raise ValueError(f"weighting must be 'relative' or 'absolute', got {weighting!r}")
    rows = list(samples)
    if len(rows) < 3:
        raise ValueError(f"fit_cost_model needs >= 3 samples, got {len(rows)}")
    ctx, bat, y = [], [], []
    for row in rows:
        try:
            c, b, s = row
        except (TypeError, ValueError):
            raise ValueError(f"each sample must be (n_context, n_batched, seconds), got {row!r}") from None
        if not (_is_int(c) and _is_int(b)) or c < 0 or b < 0:
            raise ValueError(f"n_context and n_batched must be ints >= 0, got {row!r}")
        if not _is_real(s) or not math.isfinite(s) or s <= 0:
            raise ValueError(f"seconds must be a finite number > 0, got {row!r}")
        ctx.append(float(c))
        bat.append(float(b))
        y.append(float(s))
    yv = np.asarray(y)
    design = np.column_stack([np.asarray(ctx), np.asarray(bat), np.ones_like(yv)])
    scale = np.abs(design).max(axis=0)
    if np.any(scale == 0) or np.linalg.matrix_rank(design / np.where(scale == 0, 1, scale)) < 3:
        raise ValueError(
            "cost-model samples are degenerate: vary n_context and n_batched independently (rank-3 design)"
        )
    a = design / scale
    w = 1.0 / yv if weighting == "relative" else np.ones_like(yv)
    coef = _nnls_small(a * w[:, None], yv * w) / scale
    coef = np.maximum(coef, 0.0)  # exact zeros stay zeros; guards -0.0
    model = CostModel(alpha=float(coef[0]), gamma=float(coef[1]), delta=float(coef[2]))

    pred = design @ coef
    rel = np.abs(pred - yv) / yv
    ss_res = float(np.sum((pred - yv) ** 2))
    ss_tot = float(np.sum((yv - yv.mean()) ** 2))
    # r^2 on seconds: 1 - SS_res / SS_tot. A constant target is always fitted exactly (delta = y, the
    # other coefficients 0, feasible for NNLS), so SS_tot = 0 means a perfect fit: r^2 = 1.
    r2 = 1.0 - ss_res / ss_tot if ss_tot > 0 else 1.0
    report = FitReport(
        n_samples=len(rows), mean_rel_error=float(rel.mean()), max_rel_error=float(rel.max()), r2=float(r2)
    )
    return model, report


# ================================================================================================
# On-disk cache
# ================================================================================================

CACHE_DIR_ENV = "ADASERVE_CACHE_DIR"
_CACHE_FORMAT = 1


def default_cache_dir() -> Path:
    """``$ADASERVE_CACHE_DIR`` if set and non-empty, else ``~/.cache/adaserve/profiles``."""
    env = os.environ.get(CACHE_DIR_ENV)
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "adaserve" / "profiles"


@dataclass(frozen=True)
class ProfileKey:
    """What a profile depends on. ``model`` is an identity string built by the caller (e.g. a hash of the
    config plus the weight files' names, sizes and mtimes); ``device`` e.g. "NVIDIA H100 80GB HBM3"."""

    device: str
    model: str
    dtype: str
    engine_version: str

    def __post_init__(self) -> None:
        for name in ("device", "model", "dtype", "engine_version"):
            v = getattr(self, name)
            if not isinstance(v, str) or not v.strip():
                raise ValueError(f"ProfileKey.{name} must be a non-empty string, got {v!r}")

    def to_dict(self) -> dict[str, str]:
        return asdict(self)

    def digest(self) -> str:
        """Stable hex id: sha256 of the canonical JSON of the fields (independent of Python's hash seed)."""
        canon = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"), ensure_ascii=True)
        return hashlib.sha256(canon.encode("ascii")).hexdigest()[:32]


class ProfileCache:
    """JSON files ``<dir>/<key digest>.json`` holding ``{"format", "key", "data"}``.

    ``load`` returns None on a miss and on anything unreadable (corrupt JSON, wrong format, a file whose
    stored key is not the one asked for): a bad cache costs a re-profile, never a crash; the problem is
    logged. ``save`` writes a temporary file in the same directory and ``os.replace``s it into place, so
    a reader sees the old file or the new one, never half of one.
    """

    def __init__(self, dir: str | os.PathLike[str] | None = None) -> None:
        self.dir = Path(dir).expanduser() if dir is not None else default_cache_dir()

    def path_for(self, key: ProfileKey) -> Path:
        return self.dir / f"{key.digest()}.json"

    def load(self, key: ProfileKey) -> dict[str, Any] | None:
        if not isinstance(key, ProfileKey):
            raise ValueError(f"key must be a ProfileKey, got {type(key).__name__}")
        path = self.path_for(key)
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return None
        except (OSError, UnicodeDecodeError) as e:
            logger.warning("profile cache %s unreadable (%s); treating as missing", path, e)
            return None
        try:
            doc = json.loads(text)
        except (json.JSONDecodeError, RecursionError) as e:
            logger.warning("profile cache %s is corrupt (%s); treating as missing", path, e)
            return None
        if not isinstance(doc, dict) or doc.get("format") != _CACHE_FORMAT or not isinstance(
            doc.get("data"), dict
        ):
            logger.warning("profile cache %s has an unexpected layout; treating as missing", path)
            return None
        if doc.get("key") != key.to_dict():
            logger.warning("profile cache %s belongs to another key; treating as missing", path)
            return None
        return doc["data"]

    def save(self, key: ProfileKey, data: Mapping[str, Any]) -> Path:
        """Write ``data`` (JSON-serialisable, finite floats) for ``key``; returns the file path.

        ValueError for data JSON cannot hold; OSError (unwritable directory, full disk) propagates: the
        caller decides whether serving without a cached profile is acceptable.
        """
        if not isinstance(key, ProfileKey):
            raise ValueError(f"key must be a ProfileKey, got {type(key).__name__}")
        if not isinstance(data, Mapping):
            raise ValueError(f"data must be a mapping, got {type(data).__name__}")
        doc = {"format": _CACHE_FORMAT, "key": key.to_dict(), "data": dict(data)}
        try:
            text = json.dumps(doc, sort_keys=True, indent=1, allow_nan=False)
        except (TypeError, ValueError) as e:
            raise ValueError(f"profile data is not JSON-serialisable: {e}") from e
        self.dir.mkdir(parents=True, exist_ok=True)
        path = self.path_for(key)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.stem}.", suffix=".tmp", dir=self.dir)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(text)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        return path
