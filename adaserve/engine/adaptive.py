"""Adaptive speculation shape: beam-search depth d and width w from the number of active requests
(AdaServe section 5.2, Eq. 8-9). Busy batches get shallow, narrow trees; idle ones deep, wide trees.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class AdaptiveConfig:
    """Bounds and constants of Eq. 8-9. The paper tunes c1, c2 by grid search and gives no values; the
    defaults below are starting points, meant to be overridden from the worker's profile.
    """

    # d never below 1: one draft step is cheap, and the SLO phase may still send only the root.
    d_min: int = 1
    # Every extra level costs a full draft forward before verification can start. With the demo pair on
    # a CPU (draft only ~4.6x cheaper than the target) d_max=8, w_max=4 lost to chain:4 on SLO attainment
    # (0.54 vs 0.75 at 2.25 req/s) while d_max=4, w_max=2 reached 0.83 (docs/benchmarks.md). A GPU with
    # a cheaper draft step can afford deeper trees: raise these there (SpecInfer's static tree is 8 deep).
    d_max: int = 4
    w_max: int = 2
    # B1: verification tokens per iteration, i.e. the profiled budget B (section 5; AdaServe measures
    # 156 on A100). B1 / (n + c1) is each request's share of the verify budget, and d = share - 1 leaves
    # room for the root, so drafted depth stays within what selection can afford to verify.
    b1: int = 128
    # B2: draft tokens per beam-search step (n * w <= B2 + c2 * n): small enough that steps 2..d stay
    # memory-bound on the draft and the fixed [n*w] shapes are cheap to graph-capture.
    b2: int = 32
    c1: int = 1  # > 0 so n + c1 never hits zero, and one request never claims the whole budget
    c2: int = 0

    def __post_init__(self) -> None:
        if self.d_min < 0 or self.d_max < self.d_min:
            raise ValueError(f"need 0 <= d_min <= d_max, got d_min={self.d_min}, d_max={self.d_max}")
        if self.w_max < 1:
            raise ValueError(f"w_max must be >= 1, got {self.w_max}")
        if self.b1 < 1 or self.b2 < 1:
            raise ValueError(f"b1 and b2 must be >= 1, got b1={self.b1}, b2={self.b2}")
        if self.c1 < 0:
            raise ValueError(f"c1 must be >= 0, got {self.c1}")


def depth_width(n_active: int, cfg: AdaptiveConfig) -> tuple[int, int]:
    """(d, w) for ``n_active`` requests:
        d = clip(floor(B1 / (n + c1)) - 1, Dmin, Dmax)     (Eq. 8)
        w = clip(floor(B2 / n) + c2, 1, Wmax)              (Eq. 9)
    n = 0 (nothing running) is treated as n = 1: the shape a lone new request would get.
    """
    if n_active < 0:
        raise ValueError(f"n_active must be >= 0, got {n_active}")
    n = max(n_active, 1)
    d = min(max(cfg.b1 // (n + cfg.c1) - 1, cfg.d_min), cfg.d_max)
    w = min(max(cfg.b2 // n + cfg.c2, 1), cfg.w_max)
    return d, w
