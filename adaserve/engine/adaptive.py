"""Adaptive speculation shape: beam-search depth d and width w from the number of active requests
(AdaServe section 5.2, Eq. 8-9). Busy batches get shallow, narrow trees; idle ones deep, wide trees.
The bounds and constants are ``config.AdaptiveConfig``.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from adaserve.engine.config import AdaptiveConfig
from adaserve.engine.smartspec import expected_emitted


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


@dataclass
class PathAcceptance:
    """alpha of a geometric model of how far down its tree a request's accepted path reaches.

    Each draft level is accepted with probability alpha until the first rejection; the maximum-likelihood
    alpha is accepted / (accepted + rejections) (a request whose whole path was accepted had no
    rejection). Summed over a window of recent iterations; ``prior`` until the first one.
    """

    window: int = 32
    prior: float = 0.7
    samples: deque[tuple[int, int]] = field(default_factory=deque)

    @property
    def alpha(self) -> float:
        acc = sum(a for a, _ in self.samples)
        trials = acc + sum(r for _, r in self.samples)
        return acc / trials if trials else self.prior

    def observe(self, accepted: int, rejections: int) -> None:
        if accepted + rejections <= 0:
            return
        self.samples.append((accepted, rejections))
        while len(self.samples) > self.window:
            self.samples.popleft()


def goodput_depth(n: int, width: int, *, alpha: float, d_min: int, d_max: int, n_context: int,
                  extra_tokens: int, t_target: Callable[[int, int], float],
                  t_draft: Callable[[int, int], float]) -> int:
    """The depth d in [max(d_min, 1), d_max] with the most expected tokens per second (SmartSpec's rule,
    for the best path of a beam tree):

        goodput(d) = n * l(alpha, d) / (d * T_draft(N_ctx, n * w) + T_target(N_ctx, n * (d + 1) + extra))

    with l(alpha, d) = (1 - alpha^(d+1)) / (1 - alpha) tokens per request (bonus included). Each beam
    step runs n * w draft tokens; verification is priced for the best path (the selection may verify
    more when those tokens pay, iteration_budget.py). ``extra``: prefill tokens in the same forward.
    Why not Eq. 8 alone: it ties depth to the budget, d = B / (n + c1) - 1, so as a backlog grows the
    trees shrink, fewer tokens are accepted per forward and the backlog grows faster; chain:4, which
    ignores B, kept up with a load that collapsed adaserve (docs/benchmarks.md).
    """
    best_d, best = max(d_min, 1), -1.0
    for d in range(max(d_min, 1), max(d_max, 1) + 1):
        cost = d * t_draft(n_context, n * width) + t_target(n_context, n * (d + 1) + extra_tokens)
        rate = n * expected_emitted(alpha, d) / max(cost, 1e-12)
        if rate > best:
            best_d, best = d, rate
    return best_d
