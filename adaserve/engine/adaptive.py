"""Adaptive speculation shape: beam-search depth d and width w from the number of active requests
(AdaServe section 5.2, Eq. 8-9). Busy batches get shallow, narrow trees; idle ones deep, wide trees.
The bounds and constants are ``config.AdaptiveConfig``.
"""

from __future__ import annotations

from adaserve.engine.config import AdaptiveConfig


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
