"""What the start-up profiler would measure on a simulated device: its table, knee budget and cost fit.

The engine in a simulated run is configured exactly as a worker on that device would be: the same
grid of sizes and contexts as ``profiler.profile_runner``, timed by the device model instead of a
clock, the same knee rule for B and the same least-squares fit of ``alpha*N_ctx + gamma*N + delta`` bent at the knee.
So the engine's own prediction error (a linear fit of a roofline) is part of the simulation.
"""

from __future__ import annotations

from typing import Any

from adaserve.bench.sim.device_model import DeviceProfile, ForwardCost
from adaserve.engine.cost.budget import RooflinePoint, choose_budget
from adaserve.engine.cost.cost_model import CostModel, fit_cost_model
from adaserve.engine.cost.profiler import ProfilerConfig, size_grid

SIM_MAX_TOKENS = 1024  # the profiler's largest n on a GPU


def profile_cost(cost: ForwardCost, cfg: ProfilerConfig) -> dict[str, Any]:
    """``profile_runner``'s output for one model, priced by ``cost`` (n tokens over min(n, 8) sequences)."""
    grid = size_grid(cfg.max_tokens or SIM_MAX_TOKENS)
    contexts = sorted({cfg.context, *cfg.fit_contexts})
    table = {c: {n: cost.seconds(n, min(n, 8) * c) for n in grid} for c in contexts}
    points = [RooflinePoint(n, table[cfg.context][n]) for n in grid]
    budget = choose_budget(points, cfg.knee)
    model, report = fit_cost_model([(min(n, 8) * c, n, table[c][n]) for c in contexts for n in grid], knee=budget)
    return {
        "table": [{"n_tokens": p.n_tokens, "latency_ms": 1e3 * p.latency_s, "tokens_per_s": p.n_tokens / p.latency_s}
                  for p in points],
        "budget": budget,
        "context": cfg.context,
        "cost_model": model.to_dict(),
        "fit": report.to_dict(),
    }


def simulated_profile(device: DeviceProfile, cfg: ProfilerConfig | None = None) -> dict[str, Any]:
    cfg = cfg or ProfilerConfig()
    return {"device": device.name, "simulated": True,
            "target": profile_cost(device.target, cfg), "draft": profile_cost(device.draft, cfg)}


def costs_of(data: dict[str, Any]) -> tuple[int, CostModel, CostModel]:
    """(budget, target cost model, draft cost model) from a profile's data."""
    return (int(data["target"]["budget"]), CostModel.from_dict(data["target"]["cost_model"]),
            CostModel.from_dict(data["draft"]["cost_model"]))
