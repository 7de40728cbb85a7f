"""Adaptive speculation shape: beam-search depth d and width w from the number of active requests
(AdaServe section 5.2, Eq. 8-9). Busy batches get shallow, narrow trees; idle ones deep, wide trees.
The bounds and constants are ``config.AdaptiveConfig``.
"""

from __future__ import annotations

from dataclasses import replace

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


def bounds_for_device(cfg: AdaptiveConfig, *, t_target_s: float, t_draft_s: float, draft_budget: int) -> AdaptiveConfig:
    """``cfg`` with d_max, w_max and B2 set from the profiled costs instead of CPU-tuned constants.

    r = t_target(1) / t_draft(1): how many draft forwards one target forward buys.
        d_max = clip(round(0.75 * r), 2, 8)   the d draft steps before verification stay under ~3/4 of
                                              the target forward (8: SpecInfer's depth). r = 5.6 for the
                                              default pair on a CPU gives 4, the depth measured best there.
        w_max = 4 if r >= 10 else 2           a wide beam needs a draft cheap enough to run its w x tokens
        B2    = the draft's own knee          draft tokens per beam step that still cost about one token
    """
    if not (t_target_s > 0 and t_draft_s > 0):
        return cfg
    r = t_target_s / t_draft_s
    d_max = min(max(round(0.75 * r), 2), 8)
    w_max = 4 if r >= 10 else 2
    return replace(cfg, d_max=max(d_max, cfg.d_min), w_max=w_max, b2=max(1, draft_budget))
