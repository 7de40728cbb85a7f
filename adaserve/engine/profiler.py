"""Timing the models: real forwards on the real device, turned into the worker's published profile.

For each n in {1, 2, 4, ...} the target runs a verification-shaped forward: ``b = min(n, 8)``
requests, each with ``context`` cached tokens and a chain of n/b new tokens, timed after warm-up with
device synchronisation, ``repeats`` times (median). Two context lengths give the samples that
separate alpha (per context token) from gamma (per batched token) in

    T_fwd = alpha * N_context + gamma * N_batched + delta        (SmartSpec Eq. 7)

What the timings mean is decided elsewhere: budget.py picks B at the knee, cost_model.py fits T_fwd,
profile_cache.py keeps the result per device, model identity, dtype and engine version.
"""

from __future__ import annotations

import hashlib
import json
import logging
import platform
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from adaserve import __version__
from adaserve.engine.batch import Segment
from adaserve.engine.budget import RooflinePoint, choose_budget, robust_latency
from adaserve.engine.config import ProfilerConfig
from adaserve.engine.cost_model import CostModel, fit_cost_model
from adaserve.engine.kv_cache import SequenceKV
from adaserve.engine.profile_cache import ProfileCache, ProfileKey
from adaserve.engine.runner import ModelRunner
from adaserve.engine.tree import TokenTree

log = logging.getLogger(__name__)


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"cpu:{cpu}:{torch.get_num_threads()}threads"


def model_identity(path: Path) -> str:
    """A content hash of the config and the weight files' names and sizes (cheap; no weight hashing)."""
    h = hashlib.sha256((path / "config.json").read_bytes())
    for f in sorted(path.glob("*.safetensors")):
        h.update(f"{f.name}:{f.stat().st_size}".encode())
    return h.hexdigest()[:16]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_forward(runner: ModelRunner, *, n_tokens: int, context: int, repeats: int, warmup: int) -> float:
    """Median seconds of one forward carrying ``n_tokens`` new tokens over ``context``-token prefixes."""
    b = min(n_tokens, 8)
    per = [n_tokens // b + (1 if i < n_tokens % b else 0) for i in range(b)]
    cache = runner.cache
    seqs = [SequenceKV() for _ in range(b)]
    try:
        for s in seqs:  # the prefix only needs to exist in the cache: its values do not matter for time
            cache.ensure(s, context)
            cache.truncate(s, context)
        segs = [Segment(s, context, TokenTree.chain([1] * k)) for s, k in zip(seqs, per, strict=True)]
        samples = []
        for i in range(warmup + repeats):
            _sync(runner.device)
            t0 = time.perf_counter()
            runner.forward(segs, all_logits=[True] * b)
            _sync(runner.device)
            if i >= warmup:
                samples.append(time.perf_counter() - t0)
        return robust_latency(samples)
    finally:
        for s in seqs:
            cache.release(s)


def _grid(limit: int) -> list[int]:
    out, n = [], 1
    while n <= limit:
        out.append(n)
        n *= 2
    return out


def profile_runner(runner: ModelRunner, cfg: ProfilerConfig, *, label: str,
                   progress: bool = True) -> dict[str, Any]:
    """Roofline table, knee budget and cost-model fit for one model."""
    default_max = 1024 if runner.device.type == "cuda" else 256
    # memory-safe: every probe's prefixes and new tokens must fit in the preallocated cache
    fits = runner.cache.capacity_tokens // 2
    limit = min(cfg.max_tokens or default_max, max(1, fits - 8 * max(cfg.context, *cfg.fit_contexts)))
    grid = _grid(limit)
    contexts = sorted({cfg.context, *cfg.fit_contexts})
    t0 = time.perf_counter()
    table: dict[int, dict[int, float]] = {c: {} for c in contexts}
    bar = tqdm(total=len(grid) * len(contexts), desc=f"profiling {label}", disable=not progress, unit="probe")
    for c in contexts:
        for n in grid:
            table[c][n] = time_forward(runner, n_tokens=n, context=c, repeats=cfg.repeats, warmup=cfg.warmup)
            bar.update()
    bar.close()
    points = [RooflinePoint(n, table[cfg.context][n]) for n in grid]
    budget = choose_budget(points, cfg.knee)
    samples = [(min(n, 8) * c, n, table[c][n]) for c in contexts for n in grid]
    cost, report = fit_cost_model(samples)
    return {
        "table": [{"n_tokens": p.n_tokens, "latency_ms": 1e3 * p.latency_s,
                   "tokens_per_s": p.n_tokens / p.latency_s} for p in points],
        "budget": budget,
        "context": cfg.context,
        "cost_model": cost.to_dict(),
        "fit": report.to_dict(),
        "seconds": time.perf_counter() - t0,
    }


@dataclass(frozen=True)
class Profile:
    """What a worker publishes: the budget, both cost models, and how they were measured."""

    device: str
    budget: int
    target_cost: CostModel
    draft_cost: CostModel | None
    data: dict[str, Any]
    cached: bool

    def to_dict(self) -> dict[str, Any]:
        return {**self.data, "cached": self.cached}


def profile_models(target: ModelRunner, draft: ModelRunner | None, *, target_path: Path,
                   draft_path: Path | None, cfg: ProfilerConfig | None = None, cache: ProfileCache | None = None,
                   force: bool = False, progress: bool = True,
                   clock: Callable[[], float] = time.perf_counter) -> Profile:
    cfg = cfg or ProfilerConfig()
    cache = cache or ProfileCache()
    dev = device_name(target.device)
    ident = model_identity(target_path) + ("+" + model_identity(draft_path) if draft_path else "")
    knee = f"{cfg.knee.criterion}:{cfg.knee.max_elasticity}:{cfg.knee.eps}"
    key = ProfileKey(device=dev, model=ident + f":ctx{cfg.context}:max{cfg.max_tokens}:knee={knee}",
                     dtype=str(target.dtype).removeprefix("torch."), engine_version=__version__)
    data = None if force else cache.load(key)
    cached = data is not None
    if data is None:
        t0 = clock()
        data = {"device": dev, "key": key.to_dict(), "target": profile_runner(target, cfg, label="target",
                                                                                progress=progress)}
        if draft is not None:
            data["draft"] = profile_runner(draft, cfg, label="draft", progress=progress)
        data["profiling_seconds"] = clock() - t0
        cache.save(key, data)
        log.info("profiled %s on %s in %.1fs: budget %d", target_path, dev, data["profiling_seconds"],
                 data["target"]["budget"])
    draft_cost = CostModel.from_dict(data["draft"]["cost_model"]) if "draft" in data else None
    return Profile(device=dev, budget=int(data["target"]["budget"]),
                   target_cost=CostModel.from_dict(data["target"]["cost_model"]), draft_cost=draft_cost,
                   data=data, cached=cached)


def plot_profile(data: dict[str, Any], path: Path) -> None:
    """Latency and tokens/s against n (log scale), the chosen budget marked, one panel per model."""
    from adaserve.plots import panels

    models = [m for m in ("target", "draft") if m in data]
    with panels(path, len(models), width=6) as (_, axes):
        for ax, name in zip(axes, models, strict=True):
            _plot_model(ax, data, name)


def _plot_model(ax: Any, data: dict[str, Any], name: str) -> None:
    rows = data[name]["table"]
    n = [r["n_tokens"] for r in rows]
    ax.plot(n, [r["latency_ms"] for r in rows], "o-", color="tab:blue", label="latency (ms)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tokens per forward (n)")
    ax.set_ylabel("latency (ms)", color="tab:blue")
    ax2 = ax.twinx()
    ax2.plot(n, [r["tokens_per_s"] for r in rows], "s--", color="tab:green", label="tokens/s")
    ax2.set_ylabel("tokens / s", color="tab:green")
    ax.axvline(data[name]["budget"], color="tab:red", linestyle=":", label=f"B = {data[name]['budget']}")
    ax.set_title(f"{name} on {data['device'][:40]}")
    ax.legend(loc="upper left")


def summary_json(profile: Profile) -> str:
    return json.dumps(profile.to_dict(), indent=2)
