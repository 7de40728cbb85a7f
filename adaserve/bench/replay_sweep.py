"""The paper's figures on the replay clock: artifact-format traces x named systems x seeds (issue 29).

One cell is one (trace, system, seed): the trace's requests, each replaying a recording of its class from
an agreement pool (sim/agreement.py), served by the system's schedule on the replay clock (sim/replay.py)
with a device profile's prices. Cells run in parallel processes, one thread each; the result holds every
cell's summary (bench/metrics.py, the same fields as ``adaserve bench``), the sweep's own wall time, and
per (trace, system) the mean and spread over seeds.

Systems are the bench's names (presets.py): ``vllm``, ``sarathi``, ``vllm-spec:K``, ``adaserve`` (the
paper's configuration), its ``adaserve+...`` refinements, or any engine policy run with the bench's own
settings (``chain:K`` is then a same-engine chain under the bench's admission: at most ``max_batch`` running,
``prefill_chunk`` tokens of mixed prefill).

Prompt lengths are the trace's ``input_length`` (the artifact's own token counts, for the paper's Llama
tokenizer), not a re-tokenisation: the replay runs no model.
"""

from __future__ import annotations

import dataclasses
import hashlib
import multiprocessing as mp
import os
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from adaserve.bench.emission_trace import EmissionTrace, read_emission_trace, trace_classes
from adaserve.bench.metrics import RequestResult, summarize
from adaserve.bench.presets import resolve
from adaserve.bench.sim.agreement import AgreementPool, prompt_sha
from adaserve.bench.sim.device_model import DeviceProfile, load_profile_file
from adaserve.bench.sim.profile import costs_of, simulated_profile
from adaserve.bench.sim.replay import ReplayEngine, ReplayRequest
from adaserve.engine.build import adaptive_for
from adaserve.engine.config import EngineConfig
from adaserve.engine.speculation.adaptive import AdaptiveConfig


@dataclass(frozen=True)
class SweepSettings:
    """What every cell shares: the device, the agreement pool, the bench's own scheduler settings."""

    device_profile: str = "artifact/llama-3.1-70b"
    pool: str = ""  # path of the agreement pool (.npz)
    baseline_tpot_ms: float = 30.0
    max_batch: int = 64  # the bench's settings, for systems that are not presets
    prefill_chunk: int = 256
    prefill_rule: str = "fixed"
    prefill_ttft_ms: float | None = None  # the "slo" rule's TTFT target for every request (the traces name none)
    kv_tokens: int | None = None  # None: KV never limits admission
    budget: int | None = None  # None: the device profile's knee
    prompt_lengths: str = "trace"  # replay_requests: "trace" or "recorded"


ADAPTIVE_FIELDS = ("d_min", "d_max", "w_max", "depth_rule")


def parse_system(system: str) -> tuple[str, dict[str, Any]]:
    """``NAME`` or ``NAME|field=value;field=value``: a bench system with EngineConfig fields set over it (``budget``,
    ``budget_rule``, ``node_value``, ``slo_order``, ``slo_margin``, ...; ``d_min``/``d_max``/``w_max``/
    ``depth_rule`` set its tree bounds). Raises ValueError, one line, for a bad field or value."""
    name, _, opts = system.partition("|")
    fields = {f.name: f.type for f in dataclasses.fields(EngineConfig)}
    out: dict[str, Any] = {}
    for item in filter(None, opts.split(";")):  # ";": the CLI separates systems by ","
        key, eq, raw = item.partition("=")
        if not eq or (key not in fields and key not in ADAPTIVE_FIELDS):
            raise ValueError(f"bad system {system!r}: {item!r} is not FIELD=VALUE of EngineConfig or its tree bounds")
        try:
            out[key] = int(raw) if raw.lstrip("-").isdigit() else float(raw) if _is_float(raw) else raw
        except ValueError:
            out[key] = raw
    return name, out


def _is_float(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def engine_config(system: str, device: DeviceProfile, s: SweepSettings) -> EngineConfig:
    """The EngineConfig a bench run of ``system`` on ``device`` would use (runner.make_engine's rule), with the
    fields a ``NAME|field=value`` system sets (parse_system)."""
    name, overrides = parse_system(system)
    data = simulated_profile(device)
    knee, tc, dc = costs_of(data)
    base = EngineConfig(policy=name, budget=s.budget or knee, adaptive=adaptive_for(AdaptiveConfig(), data),
                        target_cost=tc, draft_cost=dc, max_batch=s.max_batch, prefill_chunk=s.prefill_chunk,
                        prefill_rule=s.prefill_rule, prefill_ttft_ms=s.prefill_ttft_ms)
    preset = resolve(name)
    cfg = base if preset is None else preset.engine_config(base)
    tree = {k: overrides.pop(k) for k in ADAPTIVE_FIELDS if k in overrides}
    return replace(cfg, adaptive=replace(cfg.adaptive, **tree), **overrides)


def replay_requests(trace: EmissionTrace, pool: AgreementPool, *, baseline_tpot_ms: float, seed: int,
                    prompt_lengths: str = "trace") -> list[ReplayRequest]:
    """The trace's requests, each replaying the recording of its own prompt where the pool has one, else one
    of its class drawn by ``seed``. ``prompt_lengths``: "trace" (the file's ``input_length``) or "recorded"
    (the recording model's token count, for a request with its own recording: what a real-model run has)."""
    if prompt_lengths not in ("trace", "recorded"):
        raise ValueError(f"prompt_lengths must be 'trace' or 'recorded', got {prompt_lengths!r}")
    rng = np.random.default_rng(seed)
    classes = trace_classes(trace)
    own = pool.by_prompt()
    out = []
    for i, r in enumerate(trace.requests):
        c = classes[r.slo_ratio]
        rec = own.get(prompt_sha(r.prompt))
        if rec is None:
            # Figure 11's files give the coding class other ratios (0.6x ... 1.6x): a positive ratio is the
            # artifact's relative (coding) class, so it replays coding's recordings
            name = c.name if c.name in pool.traces or r.slo_ratio <= 0 or "coding" not in pool.traces else "coding"
            recs = pool.for_class(name)
            rec = recs[int(rng.integers(len(recs)))]
        n_prompt = rec.prompt_len if prompt_lengths == "recorded" and rec.prompt_len else r.input_length
        out.append(ReplayRequest(f"req-{i:05d}", c.name, r.emission_s, max(1, n_prompt), r.output_length,
                                 c.tpot_slo_ms(baseline_tpot_ms), rec))
    return out


def run_cell(trace_path: str, system: str, seed: int, s: SweepSettings) -> dict[str, Any]:
    """One (trace, system, seed): the bench's summary fields, the replay's totals, and its host seconds."""
    t0 = time.perf_counter()
    trace = read_emission_trace(Path(trace_path))
    pool = AgreementPool.load(Path(s.pool))
    device = load_profile_file(s.device_profile)
    cfg = engine_config(system, device, s)
    reqs = replay_requests(trace, pool, baseline_tpot_ms=s.baseline_tpot_ms, seed=seed, prompt_lengths=s.prompt_lengths)
    eng = ReplayEngine(cfg, device, cfg.target_cost, cfg.draft_cost, seed=seed, kv_tokens=s.kv_tokens)  # type: ignore[arg-type]
    tot = eng.run(reqs)
    results = [RequestResult(r.request_id, r.slo_class, r.tpot_slo_ms or float("inf"), r.emitted, r.tpot_ms,
                             r.ttft_ms, tuple(r.accepted_per_step), "length") for r in reqs]
    summary = summarize(results, wall_s=max(tot.end_s, trace.window_s), window_s=trace.window_s)
    return {"trace": Path(trace_path).name, "trace_sha256": trace.sha256, "rate_rps": trace.rate_rps,
            "system": system, "seed": seed, **summary, "ttft": ttft_report(results),
            "replay": {"iterations": tot.iterations, "target_s": tot.target_s, "draft_s": tot.draft_s,
                       "idle_s": tot.idle_s, "end_s": tot.end_s,
                       "verified_per_decode_iteration": (tot.tokens_verified / tot.decode_iterations
                                                         if tot.decode_iterations else None),
                       "budget": cfg.budget, "budget_rule": cfg.budget_rule, "max_batch": cfg.max_batch,
                       "prefill": [cfg.prefill_mode, cfg.prefill_rule, cfg.prefill_chunk],
                       "tree": [cfg.adaptive.d_min, cfg.adaptive.d_max, cfg.adaptive.w_max, cfg.adaptive.depth_rule],
                       "node_value": cfg.node_value},
            "host_s": time.perf_counter() - t0}


# TTFT targets (s) the report counts against: the artifact's traces name none and the paper's metric is TPOT
# alone, so a cell says how many requests would also meet each of these (the gateway's coding class: 2 s)
TTFT_TARGETS_S = (1.0, 2.0, 5.0)


def ttft_report(results: Sequence[RequestResult]) -> dict[str, Any]:
    """TTFT's median and p90 (ms), and per target in TTFT_TARGETS_S the share of requests whose first token
    came within it, alone and together with their TPOT target."""
    ttft = np.array([r.ttft_ms if r.ttft_ms is not None else np.inf for r in results])
    met = np.array([r.met_slo for r in results])
    if not len(ttft):
        return {}
    return {"p50_ms": float(np.median(ttft)), "p90_ms": float(np.percentile(ttft, 90)),
            "within": {f"{t:g}s": float(np.mean(ttft <= 1e3 * t)) for t in TTFT_TARGETS_S},
            "within_and_tpot_met": {f"{t:g}s": float(np.mean((ttft <= 1e3 * t) & met)) for t in TTFT_TARGETS_S}}


def _cell(args: tuple[str, str, int, SweepSettings]) -> dict[str, Any]:
    import torch

    torch.set_num_threads(1)
    return run_cell(*args)


X_AXES = {"rate": "request rate (req/s)", "prop": "share of coding (urgent) requests", "slo": "coding SLO (x baseline)"}


def x_of(trace_name: str, rate: float) -> tuple[str, float]:
    """A point's x: the artifact's file names say what a figure sweeps (``..._prop0.6.json``: Figure 10's
    urgent share, ``..._slo1.2_...``: Figure 11's SLO scale); otherwise the trace's rate (Figures 8-9)."""
    m = re.search(r"_(prop|slo)([0-9]+(?:\.[0-9]+)?)", trace_name)
    return (m.group(1), float(m.group(2))) if m else ("rate", rate)


def aggregate(cells: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (trace, system): mean, min and max over seeds of attainment, window goodput and per-class attainment."""
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for c in cells:
        groups.setdefault((c["trace"], c["system"]), []).append(c)
    out = []
    for (trace, system), cs in groups.items():
        def spread(xs: list[float]) -> dict[str, float]:
            return {"mean": float(np.mean(xs)), "min": float(np.min(xs)), "max": float(np.max(xs))}

        axis, x = x_of(trace, cs[0]["rate_rps"])
        row = {"trace": trace, "rate_rps": cs[0]["rate_rps"], "axis": axis, "x": x, "system": system, "seeds": len(cs),
               "slo_attainment": spread([c["slo_attainment"] for c in cs]),
               "goodput_window_tok_s": spread([c["goodput_window_tok_s"] or 0.0 for c in cs]),
               "per_class_attainment": {k: spread([c["per_class"][k]["slo_attainment"] for c in cs])
                                        for k in cs[0]["per_class"]}}
        out.append(row)
    return out


def sweep(traces: Sequence[str], systems: Sequence[str], seeds: Sequence[int], s: SweepSettings, *,
          jobs: int = 1, progress: bool = True,
          on_cell: Callable[[list[dict[str, Any]]], None] | None = None) -> dict[str, Any]:
    """Every cell, ``jobs`` processes at once; the result (see the module docstring). ``on_cell`` sees the
    cells finished so far after each one (the CLI keeps a partial file, so a long sweep cut short keeps them)."""
    device = load_profile_file(s.device_profile)
    for name in systems:
        engine_config(name, device, s)  # a bad name or field fails before any cell runs
    pool_meta = AgreementPool.load(Path(s.pool))
    t0 = time.perf_counter()
    args = [(t, sysname, seed, s) for t in traces for sysname in systems for seed in seeds]
    cells: list[dict[str, Any]] = []
    from tqdm import tqdm

    bar = tqdm(total=len(args), desc="replay cells", disable=not progress)
    if jobs <= 1:
        for a in args:
            cells.append(_cell(a))
            bar.update()
            if on_cell is not None:
                on_cell(cells)
    else:
        ctx = mp.get_context("spawn")
        with ctx.Pool(jobs) as pool:
            for c in pool.imap_unordered(_cell, args):
                cells.append(c)
                bar.update()
                if on_cell is not None:
                    on_cell(cells)
    bar.close()
    cells.sort(key=lambda c: (x_of(c["trace"], c["rate_rps"]), c["trace"], list(systems).index(c["system"]), c["seed"]))
    pool_sha = hashlib.sha256(Path(s.pool).read_bytes()).hexdigest()
    points = sorted(aggregate(cells), key=lambda p: (p["axis"], p["x"], list(systems).index(p["system"])))
    return {"settings": {**vars(replace(s)), "cpu_count": os.cpu_count(), "jobs": jobs},
            "pool": {"file": Path(s.pool).name, "sha256": pool_sha, "meta": pool_meta.meta,
                     "summary": pool_meta.summary()},
            "sweep_wall_s": time.perf_counter() - t0, "cells": cells, "points": points}



def record_pool(model: str, trace_path: str, out: Path, *, per_class: int = 40, output_tokens: int | None = None,
                seed: int = 0, progress: bool = True) -> AgreementPool:
    """Record an agreement pool with a real model pair on ``per_class`` distinct prompts of each class of a
    trace (drawn by ``seed``), outputs as long as the trace's first request's (or ``output_tokens``); saved
    to ``out`` with what made it."""
    import torch
    from tqdm import tqdm

    from adaserve.bench.sim.agreement import record_agreement
    from adaserve.engine.loading.catalog import resolve as resolve_model
    from adaserve.engine.loading.loader import load_model, load_tokenizer
    from adaserve.engine.model.runner import ModelRunner

    trace = read_emission_trace(Path(trace_path))
    n_out = output_tokens or trace.requests[0].output_length
    pair = resolve_model(model, progress=progress)
    if pair.draft is None:
        raise ValueError(f"model {model!r} has no draft to record agreement with")
    dev = torch.device("cpu")
    target = ModelRunner(load_model(pair.target, device=dev, progress=progress))
    draft = ModelRunner(load_model(pair.draft, device=dev, progress=progress))
    tok = load_tokenizer(pair.target)
    room = min(target.model.cfg.max_position_embeddings, draft.model.cfg.max_position_embeddings) - n_out - 1
    classes = trace_classes(trace)
    rng = np.random.default_rng(seed)
    prompts: list[tuple[str, list[int], str]] = []
    for ratio, c in classes.items():
        distinct = sorted({r.prompt for r in trace.requests if r.slo_ratio == ratio})
        picked = rng.choice(len(distinct), size=min(per_class, len(distinct)), replace=False)
        for k in sorted(picked):
            text = distinct[int(k)]
            prompts.append((c.name, tok.encode(text)[-room:], prompt_sha(text)))
    bar = tqdm(total=len(prompts), desc="recording agreement", disable=not progress)
    last = [0]

    def tick(done: int) -> None:
        bar.update(done - last[0])
        last[0] = done

    pool = record_agreement(target, draft, prompts, output_tokens=n_out, on_progress=tick)
    bar.close()
    pool.meta = {"model": model, "target": str(pair.target.name), "draft": str(pair.draft.name),
                 "trace": trace.name, "trace_sha256": trace.sha256, "per_class": per_class,
                 "output_tokens": n_out, "seed": seed, "greedy": True}
    pool.save(out)
    return pool


def plot_points(points: Sequence[dict[str, Any]], path: Path) -> None:
    """Attainment and window goodput against the sweep's x (rate, urgent share or SLO scale), a line per
    system, the spread over seeds as a band."""
    from adaserve.plots import panels

    systems = list(dict.fromkeys(p["system"] for p in points))
    axis = points[0]["axis"] if points else "rate"
    with panels(path, 2) as (_, axes):
        for metric, ax, label in (("slo_attainment", axes[0], "SLO attainment"),
                                  ("goodput_window_tok_s", axes[1], "goodput over the window (tok/s)")):
            for name in systems:
                rows = sorted((p for p in points if p["system"] == name), key=lambda p: p["x"])
                x = [p["x"] for p in rows]
                ax.plot(x, [p[metric]["mean"] for p in rows], marker="o", label=name)
                ax.fill_between(x, [p[metric]["min"] for p in rows], [p[metric]["max"] for p in rows], alpha=0.2)
            ax.set_xlabel(X_AXES[axis])
            ax.set_ylabel(label)
            ax.grid(alpha=0.3)
        axes[0].legend(fontsize=7)
