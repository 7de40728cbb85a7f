"""Fitting the forward-cost model ``T_fwd = alpha * N_context + beta * N_cells + gamma * N_batched + delta``
(+ ``gamma_above * max(0, N_batched - knee)`` past the roofline's knee).

SmartSpec's model (section 4.3): alpha the KV-cache read per context token, gamma the compute per
batched token, delta the weight load. A forward is flat while weights dominate and turns linear once
compute does (the roofline's ridge), which one straight line cannot follow: fitted over 1-1024 tokens
of a simulated A100 it over-predicted the knee's forward by 32% and under-predicted 512 tokens by 16%.
Given the knee (the profiler's B), a hinge term bends the line there (0.3% mean error on that table).

beta prices the attention cells, ``N_cells = sum_i (new_i * context_i + new_i (new_i + 1) / 2)``: each new token
times the keys it attends to, its sequence's cached tokens and the sequence's new tokens up to itself
(``model/runner.chunk_cells``), apart from alpha's context read. SmartSpec's alpha reads each sequence's cache once
per forward, as a GPU's attention kernels do; a CPU's attention (native/attend.c) reads it once per new token, so a
sequence with k new tokens costs k times its context. One token per sequence makes the two the same up to each
token's own key (``N_cells = N_context + n``), so the profiler's probes of several tokens a sequence are what separate
them: without beta their attention went into alpha, and a CPU profile over-predicted its served forwards at 32
requests by 41% (14% with beta; docs/benchmarks.md, "Twenty-sixth round"). Where the samples cannot tell the two
apart, beta is 0 and the model is SmartSpec's.

The chunk's own keys are what a prompt chunk's attention is made of: 512 prompt tokens over an empty cache read
131,328 keys and no context. Every segment is counted as a causal chunk; a tree's nodes see only their ancestors
among the new ones (at most their depth each), tens of cells against the thousands of a verification's context
(docs/benchmarks.md, "Twenty-seventh round").

The profiler fits it at start-up with :func:`fit_cost_model`; the engine predicts each iteration's
duration with it (A(r), SmartSpec's goodput), and workers publish it for the gateway's headroom
(docs/architecture.md §8; the gateway reads the straight part). timing.py refits it online when no profile exists.

Pure logic: numpy and the standard library only.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Literal

import numpy as np

from adaserve.engine.checks import is_int, is_real

__all__ = ["CostModel", "FitReport", "even_cells", "fit_cost_model"]


def even_cells(n_context: float, n_batched: float, n_sequences: int) -> float:
    """``model/runner.chunk_cells`` summed over ``n_sequences`` sequences that share ``n_context`` cached tokens and
    ``n_batched`` new ones evenly (what a policy knows of a batch: its totals), ``m = n_batched / n`` new tokens each:
    ``n (m n_context / n + m (m + 1) / 2) = n_context m + n_batched (m + 1) / 2``. The gateway's prior prices a
    worker's published beta the same way (gateway/prediction.py; its tests hold the two together)."""
    m = n_batched / (n_sequences if n_sequences > 1 else 1)
    return n_context * m + n_batched * (m + 1) / 2



@dataclass(frozen=True)
class CostModel:
    """SmartSpec's forward-time model, seconds. alpha: per context token (KV read), gamma: per batched
    token (compute), delta: fixed (weight load, launch); gamma_above: the extra slope per batched token
    past ``knee`` (0: a straight line); beta: per attention cell, a new token times a key it attends to
    (``model/runner.chunk_cells``; 0: SmartSpec's model). All >= 0."""

    alpha: float
    gamma: float
    delta: float
    gamma_above: float = 0.0
    knee: int = 0
    beta: float = 0.0

    def __post_init__(self) -> None:
        for name in ("alpha", "gamma", "delta", "gamma_above", "beta"):
            v = getattr(self, name)
            if not is_real(v) or not math.isfinite(v) or v < 0:
                raise ValueError(f"CostModel.{name} must be a finite number >= 0, got {v!r}")
        if not is_int(self.knee) or self.knee < 0:
            raise ValueError(f"CostModel.knee must be an int >= 0, got {self.knee!r}")

    def predict(self, n_context: int, n_batched: int, n_cells: float | None = None) -> float:
        """T_fwd in seconds for a forward reading n_context cached tokens and computing n_batched new ones;
        ``n_cells``: the attention cells (``model/runner.chunk_cells`` over the sequences; None: one new token a
        sequence, ``n_context + n_batched``)."""
        if n_context < 0 or n_batched < 0:
            raise ValueError(f"token counts must be >= 0, got n_context={n_context}, n_batched={n_batched}")
        over = n_batched - self.knee  # max(0, over) without the call (issue 30: a dozen predictions an iteration)
        return (self.alpha * n_context + self.gamma * n_batched + self.delta
                + self.gamma_above * (over if over > 0 else 0)
                + self.beta * (n_context + n_batched if n_cells is None else n_cells))

    def scaled(self, k: float) -> CostModel:
        """Every term times k (the same shape, k times slower)."""
        return CostModel(alpha=k * self.alpha, gamma=k * self.gamma, delta=k * self.delta,
                         gamma_above=k * self.gamma_above, knee=self.knee, beta=k * self.beta)

    def to_dict(self) -> dict[str, float]:
        d = {"alpha": float(self.alpha), "gamma": float(self.gamma), "delta": float(self.delta)}
        if self.gamma_above > 0:  # a straight line keeps the three keys every reader knows
            d |= {"gamma_above": float(self.gamma_above), "knee": int(self.knee)}
        if self.beta > 0:  # and SmartSpec's model keeps them too
            d["beta"] = float(self.beta)
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> CostModel:
        if not isinstance(d, Mapping):
            raise ValueError(f"CostModel.from_dict expects a mapping, got {type(d).__name__}")
        missing = {"alpha", "gamma", "delta"} - set(d)
        if missing:
            raise ValueError(f"CostModel.from_dict: missing keys {sorted(missing)}")
        return cls(alpha=d["alpha"], gamma=d["gamma"], delta=d["delta"],
                   gamma_above=d.get("gamma_above", 0.0), knee=d.get("knee", 0), beta=d.get("beta", 0.0))


@dataclass(frozen=True)
class FitReport:
    """Quality of a cost-model fit on its own samples. Relative error e_i = |pred_i - y_i| / y_i."""

    n_samples: int
    mean_rel_error: float
    max_rel_error: float
    r2: float

    def to_dict(self) -> dict[str, float | int]:
        return asdict(self)


_EPS = float(np.finfo(np.float64).eps)


def _rank(m: np.ndarray) -> int:
    """``np.linalg.matrix_rank(m)`` by its own rule (singular values above max(S) * max(m.shape) * eps), without
    its wrapper's overhead: a third of its time on a small matrix."""
    s = np.linalg.svd(m, compute_uv=False)  # descending: s[0] is the largest
    return int(np.count_nonzero(s > s[0] * max(m.shape) * _EPS))


def _least_squares(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, int]:
    """The unconstrained least-squares solution of ``a x = b`` and ``a``'s rank (``np.linalg.lstsq``'s: one SVD)."""
    x, _, rank, _ = np.linalg.lstsq(a, b, rcond=None)
    return x, int(rank)


def _nnls_small(a: np.ndarray, b: np.ndarray, *, first: Sequence[int] | None = None,
                full: tuple[np.ndarray, int] | None = None) -> tuple[np.ndarray, int]:
    """argmin_{x >= 0} ||a x - b||_2 for a handful of columns, exactly; with ``a``'s rank (np.linalg.lstsq's).

    The problem is convex, so a feasible x is the optimum iff it meets the KKT conditions: the gradient
    g = a^T (a x - b) is 0 on x's support and >= 0 off it. A support's unconstrained least-squares solution has
    g = 0 on that support, so the optimum is among those solutions (``_nnls_enumerated`` tries them all). Where
    ``a`` has full column rank the optimum is unique, and the first positive solution that meets KKT is it: the
    full support first (all coefficients > 0: the usual case for a cost model's window), then the supports one
    column smaller, and so on; one to four solves instead of 2^p - 1 (issue 30: the online model's refit was
    ~0.7 ms of host time). A rank-deficient ``a`` (several optima), or none found (g's rounding at a boundary), is
    left to the enumeration, whose tie rule picks among equal fits.

    ``first``: a support (column indices, ascending) to try before the others (the online model's last fit's: a
    window that moved by a quarter often keeps it, and the ordered search solves several supports). Only one support can
    pass at full rank (a positive solution meeting KKT is the unique optimum, whose support is that one), so the
    hint changes nothing but the number of solves: the same lstsq call on the same columns, the same bits (short of
    a coefficient whose optimum is 0 within rounding, where either support is the optimum to the last bits).
    ``full``: ``_least_squares(a, b)`` where the caller has it already.
    """
    p = a.shape[1]
    x_full, rank = full if full is not None else _least_squares(a, b)
    if rank < p:
        return _nnls_enumerated(a, b), rank
    if min(x_full.tolist()) > 0:
        return x_full, p
    gram, corr = a.T @ a, a.T @ b
    hint = [tuple(first)] if first is not None and 0 < len(first) < p else []  # the full support was solved above
    for support in itertools.chain(hint, *(itertools.combinations(range(p), k) for k in range(p - 1, 0, -1))):
        cols = list(support)
        xs = np.linalg.lstsq(a[:, cols], b, rcond=None)[0]
        if min(xs.tolist()) <= 0:
            continue
        x = np.zeros(p)
        x[cols] = xs
        g = (gram @ x - corr).tolist()  # g = a^T (a x - b): 0 on the support up to rounding
        if all(g[j] >= 0 for j in range(p) if j not in support):
            return x, p
    return _nnls_enumerated(a, b), p


def _nnls_enumerated(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``_nnls_small`` by enumerating supports: solving lstsq for every one of the 2^p supports, keeping the
    non-negative solutions and taking the smallest residual finds x* (it is among the candidates, and every
    candidate is feasible). No iteration, no tolerance to tune; fine for p <= ~10."""
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
    samples: Sequence[tuple[int, int, float] | tuple[int, int, float, float]],
    *,
    weighting: Literal["relative", "absolute"] = "relative",
    knee: int | None = None,
) -> tuple[CostModel, FitReport]:
    """Fit (alpha, beta, gamma, delta) >= 0 to (N_context, N_batched, seconds[, N_cells]) samples by least squares.

    Model: y_i ~ alpha * c_i + beta * k_i + gamma * b_i + delta, k_i the sample's attention cells (``c_i + b_i`` when
    a sample leaves them out: one new token a sequence). Solved as non-negative least squares (a negative
    coefficient is non-physical, and would predict negative or shrinking times off the sampled range).

    weighting="relative" (default) minimises sum ((pred_i - y_i) / y_i)^2: timing noise is roughly
    multiplicative, and the engine needs small forwards predicted as accurately (in %) as large ones.
    weighting="absolute" minimises sum (pred_i - y_i)^2, plain OLS on seconds.

    Columns are scaled to unit max before solving (N_context ~ 1e5 next to 1, conditioning), which
    leaves the sign constraints unchanged. The samples must vary N_context and N_batched independently
    (design matrix of rank 3), otherwise alpha/gamma/delta are not identifiable and ValueError is raised.
    beta is fitted only where the cells vary apart from those three columns (else it is 0).

    ``knee``: also fit ``gamma_above`` on the column max(0, b_i - knee), when at least two samples lie past
    the knee (else the line is straight). The hinge sits where the profiler found the roofline's knee;
    fitting its position too would make the problem non-linear for little gain.
    """
    if weighting not in ("relative", "absolute"):
        raise ValueError(f"weighting must be 'relative' or 'absolute', got {weighting!r}")
    rows = list(samples)
    if len(rows) < 3:
        raise ValueError(f"fit_cost_model needs >= 3 samples, got {len(rows)}")
    ctx, bat, y, cells = [], [], [], []
    for row in rows:
        if not isinstance(row, Sequence) or len(row) not in (3, 4):
            raise ValueError(f"each sample must be (n_context, n_batched, seconds[, n_cells]), got {row!r}")
        c, b, s = row[:3]
        k = row[3] if len(row) == 4 else c + b
        if not (is_int(c) and is_int(b)) or c < 0 or b < 0:
            raise ValueError(f"n_context and n_batched must be ints >= 0, got {row!r}")
        if not is_real(k) or not math.isfinite(k) or k < 0:
            raise ValueError(f"n_cells must be a finite number >= 0, got {row!r}")
        if not is_real(s) or not math.isfinite(s) or s <= 0:
            raise ValueError(f"seconds must be a finite number > 0, got {row!r}")
        ctx.append(float(c))
        bat.append(float(b))
        y.append(float(s))
        cells.append(float(k))
    return fit_arrays(np.asarray(ctx), np.asarray(bat), np.asarray(y), cells=np.asarray(cells), weighting=weighting,
                      knee=knee)


DEGENERATE = "cost-model samples are degenerate: vary n_context and n_batched independently (rank-3 design)"


def fit_model(ctx: np.ndarray, bat: np.ndarray, yv: np.ndarray, *, cells: np.ndarray | None = None,
              weighting: Literal["relative", "absolute"] = "relative",
              knee: int | None = None, akaike: bool = True, last: CostModel | None = None) -> CostModel:
    """``fit_arrays``'s model without its report: what the online model refits its window with, with no Python pass
    over the samples and none of the report's sums (issue 30).

    With ``cells``, beta is kept only where it earns its parameter (``akaike``: Akaike's rule on the weighted squared
    residuals S of the n samples, ``n log S + 2 k`` smaller with it, so S at least ``1 - exp(-2 / n)`` lower, about
    10% for the profiler's 18 probes): a noisy table can trade the batched tokens' gamma for the cells' beta, which
    vary with them at each context, without fitting any better. The online model's window of a few hundred forwards
    skips the rule (its bar is under 1%) and the second solve it takes (issue 30: ~0.3 ms a refit in the engine).

    ``last``: the model this fit replaces (the online model's previous refit): the terms it kept are the first support
    the non-negative solve tries (``_nnls_small``'s ``first``), the same model in fewer solves."""
    if weighting not in ("relative", "absolute"):
        raise ValueError(f"weighting must be 'relative' or 'absolute', got {weighting!r}")
    if len(yv) < 3:
        raise ValueError(f"fit_cost_model needs >= 3 samples, got {len(yv)}")
    # one new token a sequence makes the cells the context plus the tokens everywhere: nothing to tell beta apart
    if cells is not None and not np.array_equal(cells, ctx + bat):
        fitted = _fit(ctx, bat, yv, cells, weighting, knee, last)
        # None: the cells vary only along the other columns (every sample the same tokens a sequence, say)
        if fitted is not None and not akaike:
            return fitted[0]
    else:
        fitted = None
    straight = _fit(ctx, bat, yv, None, weighting, knee, last)
    assert straight is not None  # only a cells column can add no rank
    if fitted is not None and fitted[1] < straight[1] * math.exp(-2.0 / len(yv)):
        return fitted[0]
    return straight[0]


def _fit(ctx: np.ndarray, bat: np.ndarray, yv: np.ndarray, cells: np.ndarray | None,
         weighting: Literal["relative", "absolute"], knee: int | None,
         last: CostModel | None = None) -> tuple[CostModel, float] | None:
    """The NNLS fit on the columns context, batched, 1[, cells][, the hinge] and its weighted squared residuals;
    ValueError where the straight columns are degenerate; None where the cells column adds no rank. ``last``: a
    model whose nonzero terms the solve tries first (``fit_model``)."""
    design = np.column_stack([ctx, bat, np.ones_like(yv)])
    if cells is not None:
        design = np.column_stack([design, cells])
    hinge = np.maximum(0.0, bat - knee) if knee is not None and knee > 0 else None
    if hinge is not None and np.count_nonzero(hinge) >= 2:
        design = np.column_stack([design, hinge])
    scale = np.abs(design).max(axis=0)
    if np.any(scale == 0):
        raise ValueError(DEGENERATE)
    w = 1.0 / yv if weighting == "relative" else np.ones_like(yv)
    a = design / scale * w[:, None]
    full = _least_squares(a, yv * w)
    rank = full[1]
    # rank 3 of the straight columns: the solve's own rank says so, unless the hinge column is what it lacks (rows
    # scaled by w > 0 keep the rank: the same rule as np.linalg.matrix_rank's on the unweighted design, and no SVD
    # of its own, ~0.15 ms of a refit's host time with cold caches). Read before the non-negative solve: a window
    # whose cells add no rank is refitted without them, so its rank-deficient solve (every support enumerated) would
    # be thrown away (issue 30)
    if rank < 3 or (rank < a.shape[1] and _rank(a[:, :3]) < 3):
        raise ValueError(DEGENERATE)
    if cells is not None and rank < a.shape[1] and _rank(a[:, :4]) < 4:
        return None
    x, _ = _nnls_small(a, yv * w, full=full, first=None if last is None else _support(last, a.shape[1], cells))
    r = a @ x - yv * w
    coef = np.maximum(x / scale, 0.0).tolist()  # exact zeros stay zeros; guards -0.0
    beta = coef.pop(3) if cells is not None else 0.0
    above = coef[3] if len(coef) > 3 else 0.0
    model = CostModel(alpha=coef[0], gamma=coef[1], delta=coef[2],
                      gamma_above=above, knee=int(knee) if above > 0 and knee is not None else 0, beta=beta)
    return model, float(r @ r)


def _support(model: CostModel, p: int, cells: np.ndarray | None) -> list[int]:
    """The columns of ``_fit``'s design (context, batched, 1[, cells][, the hinge]; ``p`` of them) whose terms are
    nonzero in ``model``."""
    terms = [model.alpha, model.gamma, model.delta, *([model.beta] if cells is not None else []), model.gamma_above]
    return [j for j, t in enumerate(terms[:p]) if t > 0]


def fit_arrays(ctx: np.ndarray, bat: np.ndarray, yv: np.ndarray, *, cells: np.ndarray | None = None,
               weighting: Literal["relative", "absolute"] = "relative",
               knee: int | None = None) -> tuple[CostModel, FitReport]:
    """``fit_cost_model`` on float64 columns a caller has already checked (counts >= 0, seconds finite > 0)."""
    model = fit_model(ctx, bat, yv, cells=cells, weighting=weighting, knee=knee)
    pred = predict_columns(model, ctx, bat, ctx + bat if cells is None else cells)
    rel = np.abs(pred - yv) / yv
    ss_res = float(np.sum((pred - yv) ** 2))
    ss_tot = float(np.sum((yv - yv.mean()) ** 2))
    # r^2 on seconds: 1 - SS_res / SS_tot. A constant target is always fitted exactly (delta = y, the
    # other coefficients 0, feasible for NNLS), so SS_tot = 0 means a perfect fit: r^2 = 1.
    r2 = 1.0 - ss_res / ss_tot if ss_tot > 0 else 1.0
    report = FitReport(
        n_samples=len(yv), mean_rel_error=float(rel.mean()), max_rel_error=float(rel.max()), r2=float(r2)
    )
    return model, report


def predict_columns(model: CostModel, ctx: np.ndarray, bat: np.ndarray, cells: np.ndarray) -> np.ndarray:
    """``model.predict(c_i, b_i, k_i)`` for every row at once, bit for bit (the same operations in the same order)."""
    return (model.alpha * ctx + model.gamma * bat + model.delta + model.gamma_above * np.maximum(0.0, bat - model.knee)
            + model.beta * cells)
