"""What a benchmark run reports: SLO attainment, goodput and friends, from finished requests.

A request meets its SLO when its mean TPOT (time per output token after the first) is at most its
target (AdaServe section 6.1). Goodput counts the output tokens of requests that met their SLO per second,
reported twice: ``goodput_tok_s`` per second of the run's makespan (``wall_s``: the later of the drain's end
and the arrival window's), and ``goodput_window_tok_s`` per second of the arrival window alone (``window_s``:
a generated workload's duration, a trace's window), the paper's definition; the two differ when the engine
drains its queue past the window's end. Throughput counts all output tokens, over the makespan.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

REFUSED = "refused"  # finish_reason of a request a gateway answered 429/503: a miss, reported apart


@dataclass(frozen=True)
class RequestResult:
    request_id: str
    slo_class: str
    tpot_slo_ms: float
    tokens: int
    tpot_ms: float | None  # None for single-token outputs: they have no per-token latency
    ttft_ms: float | None
    accepted_per_step: tuple[int, ...]
    finish_reason: str | None

    @property
    def met_slo(self) -> bool:
        if self.finish_reason in (None, "abort", "error", REFUSED):
            return False
        return self.tpot_ms is None or self.tpot_ms <= self.tpot_slo_ms


def _mean(xs: Sequence[float]) -> float | None:
    return float(np.mean(xs)) if len(xs) else None


def _percentile(xs: Sequence[float], q: float) -> float | None:
    return float(np.percentile(xs, q)) if len(xs) else None


def summarize(results: Sequence[RequestResult], *, wall_s: float, select_s: float = 0.0,
              step_s: float = 0.0, window_s: float | None = None) -> dict:
    """Aggregate one (policy, rate) run. ``wall_s``: the makespan; ``window_s``: the arrival window (None or 0:
    no window goodput); ``select_s`` / ``step_s``: scheduler and total iteration time."""
    if wall_s <= 0:
        raise ValueError("wall_s must be positive")
    window = window_s if window_s is not None and window_s > 0 else None

    def per_window(tokens: int) -> float | None:
        return tokens / window if window is not None else None

    tpots = [r.tpot_ms for r in results if r.tpot_ms is not None]
    accepted = [a for r in results for a in r.accepted_per_step]
    met = [r for r in results if r.met_slo]
    per_class = {}
    for name in sorted({r.slo_class for r in results}):
        rs = [r for r in results if r.slo_class == name]
        ok = [r for r in rs if r.met_slo]
        per_class[name] = {
            "requests": len(rs),
            "slo_attainment": len(ok) / len(rs),
            "goodput_tok_s": sum(r.tokens for r in ok) / wall_s,  # over the makespan
            "goodput_window_tok_s": per_window(sum(r.tokens for r in ok)),  # over the arrival window
            "mean_tpot_ms": _mean([r.tpot_ms for r in rs if r.tpot_ms is not None]),
            "tpot_slo_ms": rs[0].tpot_slo_ms,
        }
    return {
        "requests": len(results),
        "slo_attainment": len(met) / len(results) if results else 0.0,
        "violations": len(results) - len(met),
        "goodput_tok_s": sum(r.tokens for r in met) / wall_s,  # over the makespan
        "goodput_window_tok_s": per_window(sum(r.tokens for r in met)),  # over the arrival window (the paper's)
        "throughput_tok_s": sum(r.tokens for r in results) / wall_s,
        "mean_tpot_ms": _mean(tpots),
        "p99_tpot_ms": float(np.percentile(tpots, 99)) if tpots else None,
        "mean_ttft_ms": _mean([r.ttft_ms for r in results if r.ttft_ms is not None]),
        "p90_ttft_ms": _percentile([r.ttft_ms for r in results if r.ttft_ms is not None], 90),
        "mean_accepted_per_verification": _mean(accepted),
        "scheduler_time_share": select_s / step_s if step_s > 0 else 0.0,
        "wall_s": wall_s,
        "window_s": window,
        "per_class": per_class,
    }


def adaserve_ratios(by_policy: dict[str, dict]) -> dict | None:
    """AdaServe against the best other policy at one rate: attainment, goodput and violations ratios."""
    if "adaserve" not in by_policy or len(by_policy) < 2:
        return None
    ours = by_policy["adaserve"]
    others = {k: v for k, v in by_policy.items() if k != "adaserve"}
    best_att = max(others, key=lambda k: others[k]["slo_attainment"])
    best_good = max(others, key=lambda k: others[k]["goodput_tok_s"])
    fewest_viol = min(others, key=lambda k: others[k]["violations"])

    def ratio(a: float, b: float) -> float | None:
        return a / b if b else None

    return {
        "attainment_vs_best": ratio(ours["slo_attainment"], others[best_att]["slo_attainment"]),
        "best_attainment_policy": best_att,
        "goodput_vs_best": ratio(ours["goodput_tok_s"], others[best_good]["goodput_tok_s"]),
        "best_goodput_policy": best_good,
        # > 1 means AdaServe has fewer violations (the paper's "x fewer SLO violations")
        "violation_reduction_vs_best": ratio(others[fewest_viol]["violations"], ours["violations"]),
        "fewest_violations_policy": fewest_viol,
    }
