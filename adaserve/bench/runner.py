"""The side-by-side benchmark: one arrival schedule, every policy, the same engine and hardware, one run.

    for each rate:   workload = build_workload(rate)            (same prompts, SLOs, arrival times)
        for each policy:   run it in real time on a fresh Engine over the shared model runners
                           summarize(requests) -> attainment, goodput, TPOT, TTFT, acceptance ...
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from adaserve.bench.hf_peer import HFPeer
from adaserve.bench.metrics import RequestResult, adaserve_ratios, summarize
from adaserve.bench.selection_gap import SelectionGap, budgeted
from adaserve.bench.workload import WorkloadConfig, WorkloadRequest, build_workload
from adaserve.engine.build import resolve_device
from adaserve.engine.chat import has_chat_template, instruction_ids
from adaserve.engine.config import EngineConfig, KVCacheConfig
from adaserve.engine.engine import Engine, TokenEvent
from adaserve.engine.loader import load_model, load_tokenizer
from adaserve.engine.policies import make_policy
from adaserve.engine.profiler import Profile, profile_models
from adaserve.engine.request import Request
from adaserve.engine.runner import ModelRunner
from adaserve.engine.sampling import SamplingParams

log = logging.getLogger(__name__)

HF_PEER = "hf"  # not an engine policy: Hugging Face transformers serving the same arrivals


@dataclass(frozen=True)
class BenchConfig:
    target: Path
    draft: Path
    model: str = ""  # the name the pair was asked for (catalog), for the report
    policies: tuple[str, ...] = ("adaserve", "incremental", "chain:4", "smartspec", "specinfer")
    rates: tuple[float, ...] = (1.0,)
    duration_s: float = 30.0
    trace: Path | None = None
    mix: dict[str, float] | None = None
    slo_scale: float = 1.0
    seed: int = 0
    device: str = "cpu"
    budget: int | None = None  # None: the profiled budget
    budgets: tuple[int | str, ...] = ()  # a sweep of adaserve budgets ("auto" = profiled)
    max_tokens_cap: int = 128
    max_prompt_tokens: int = 512
    kv_memory_mb: int = 512
    baseline_tpot_ms: float | None = None  # measured when None

    def __post_init__(self) -> None:
        if not self.policies and not self.budgets:
            raise ValueError("give at least one policy or budget")
        if not self.rates or min(self.rates) <= 0:
            raise ValueError("rates must be positive")
        if self.duration_s <= 0:
            raise ValueError("duration must be positive")
        for p in self.policies:
            if p != HF_PEER:
                make_policy(p)  # raises ValueError naming the bad policy


@dataclass
class Variant:
    label: str
    policy: str
    budget: int


@dataclass
class Shared:
    target: ModelRunner
    draft: ModelRunner
    tokenizer: Any
    profile: Profile | None
    budget: int
    variants: list[Variant] = field(default_factory=list)
    hf: HFPeer | None = None


def load_shared(cfg: BenchConfig, *, progress: bool) -> Shared:
    dev = resolve_device(cfg.device)
    rc = EngineConfig(kv=KVCacheConfig(memory_bytes=cfg.kv_memory_mb * 2**20))
    target = ModelRunner(load_model(cfg.target, device=dev, progress=progress), rc)
    draft = ModelRunner(load_model(cfg.draft, device=dev, progress=progress), rc)
    needs_profile = cfg.budget is None or "auto" in cfg.budgets
    prof = (profile_models(target, draft, target_path=cfg.target, draft_path=cfg.draft, progress=progress)
            if needs_profile else None)
    budget = cfg.budget if cfg.budget is not None else (prof.budget if prof else EngineConfig().budget)
    shared = Shared(target, draft, load_tokenizer(cfg.target), prof, budget)
    shared.variants = [Variant(p, p, budget) for p in cfg.policies]
    if HF_PEER in cfg.policies:
        eos = shared.target.model.cfg.eos_token_ids
        pad = shared.tokenizer.pad_token_id if shared.tokenizer.pad_token_id is not None else (eos[0] if eos else 0)
        shared.hf = HFPeer(cfg.target, cfg.draft, eos_token_id=eos[0] if eos else None, pad_token_id=pad)
    for b in cfg.budgets:
        value = prof.budget if b == "auto" and prof else int(b)
        shared.variants.append(Variant(f"adaserve@B={b}" + (f"({value})" if b == "auto" else ""), "adaserve", value))
    return shared


def make_engine(shared: Shared, variant: Variant) -> Engine:
    prof = shared.profile
    cfg = EngineConfig(policy=variant.policy, budget=variant.budget,
                       target_cost=prof.target_cost if prof else None, draft_cost=prof.draft_cost if prof else None)
    draft = shared.draft if make_policy(cfg.policy, cfg).max_shape is not None else None
    return Engine(shared.target, draft, cfg)


def measure_baseline_tpot(shared: Shared, *, tokens: int = 48, runs: int = 5) -> float:
    """Unloaded per-token latency of the target alone (incremental decoding, one request), in ms.

    The minimum over runs after a warm-up: interference from anything else on the machine only ever
    adds time, and every SLO of the workload is a multiple of this number.
    """
    out = []
    for i in range(runs + 1):
        eng = make_engine(shared, Variant("baseline", "incremental", shared.budget))
        req = Request(f"baseline-{i}", shared.tokenizer.encode("def main():"),
                      SamplingParams(max_tokens=tokens, ignore_eos=True))
        eng.run([(0.0, req)])
        if i > 0 and req.metrics.tpot_ms is not None:  # the first run warms up
            out.append(req.metrics.tpot_ms)
    return min(out)


def to_requests(workload: list[WorkloadRequest], shared: Shared, cfg: BenchConfig) -> list[tuple[float, Request]]:
    out = []
    for w in workload:
        # the tail keeps the chat template's opening of the assistant turn when a prompt is cut
        ids = instruction_ids(shared.tokenizer, w.prompt)[-cfg.max_prompt_tokens:]
        req = Request(w.request_id, ids, SamplingParams(max_tokens=w.max_tokens, seed=cfg.seed),
                      tpot_slo_ms=w.tpot_slo_ms)
        out.append((w.arrival_s, req))
    return out


def run_variant(shared: Shared, variant: Variant, workload: list[WorkloadRequest], cfg: BenchConfig,
                bar: tqdm) -> tuple[dict, dict[str, list[int]]]:
    """One (variant, workload) run: its summary and every request's output tokens."""
    arrivals = to_requests(workload, shared, cfg)
    classes = {w.request_id: w.slo_class for w in workload}
    select_s = step_s = 0.0
    gap = SelectionGap() if budgeted(variant.policy) else None  # Algorithm 2 (and kin) against Algorithm 1
    t0 = time.perf_counter()
    if variant.policy == HF_PEER:
        assert shared.hf is not None
        shared.hf.run(arrivals, on_done=bar.update)
    else:
        eng = make_engine(shared, variant)
        if gap is not None:
            eng.selection_listeners.append(gap.observe)

        def on_step(events: list[TokenEvent]) -> None:
            bar.update(sum(1 for e in events if e.finished))

        eng.run(arrivals, on_step=on_step)
        select_s, step_s = eng.totals.t_select_s, eng.totals.t_step_s
    wall = time.perf_counter() - t0
    results = [
        RequestResult(r.request_id, classes[r.request_id], float(r.tpot_slo_ms or 0.0), len(r.output_ids),
                      r.metrics.tpot_ms, r.metrics.ttft_ms, tuple(r.metrics.accepted_per_step), r.finish_reason)
        for _, r in arrivals
    ]
    summary = summarize(results, wall_s=max(wall, cfg.duration_s), select_s=select_s, step_s=step_s)
    if gap is not None:
        summary["selection_vs_optimal"] = gap.summary()
    return summary, {r.request_id: r.output_ids for _, r in arrivals}


def same_outputs(ours: dict[str, list[int]], reference: dict[str, list[int]]) -> float:
    """Share of requests whose tokens equal the reference's (1.0 = lossless against it)."""
    return sum(ours[k] == reference[k] for k in reference) / len(reference) if reference else 1.0


def run_bench(cfg: BenchConfig, *, progress: bool = True) -> dict:
    shared = load_shared(cfg, progress=progress)
    baseline = cfg.baseline_tpot_ms or measure_baseline_tpot(shared)
    workloads = {}
    for rate in cfg.rates:
        wc = WorkloadConfig(rate, cfg.duration_s, baseline_tpot_ms=baseline, seed=cfg.seed,
                            slo_scale=cfg.slo_scale, max_tokens_cap=cfg.max_tokens_cap, trace=cfg.trace,
                            **({"mix": cfg.mix} if cfg.mix else {}))
        workloads[rate] = build_workload(wc)
    total = sum(len(w) for w in workloads.values()) * len(shared.variants)
    rows: list[dict] = []
    ratios: dict[str, Any] = {}
    with tqdm(total=total, desc="bench", unit="req", disable=not progress) as bar:
        for rate, wl in workloads.items():
            if not wl:
                log.warning("rate %.3g over %.0fs gives no requests: skipped", rate, cfg.duration_s)
                continue
            by_label = {}
            reference: dict[str, list[int]] | None = None
            for v in shared.variants:
                bar.set_postfix_str(f"{v.label} @ {rate:g} rps")
                summary, outputs = run_variant(shared, v, wl, cfg, bar)
                # greedy everywhere: every engine policy must reproduce the first one's tokens exactly
                if v.policy != HF_PEER:
                    reference = reference or outputs
                match = same_outputs(outputs, reference) if reference else None
                by_label[v.label] = summary
                rows.append({"policy": v.label, "rate_rps": rate, "budget": v.budget,
                             "outputs_equal_reference": match, **summary})
            ratios[f"{rate:g}"] = adaserve_ratios(by_label)
    return {
        "device": shared.profile.device if shared.profile else cfg.device,
        "budget": shared.budget,
        "baseline_tpot_ms": baseline,
        "config": {"policies": list(cfg.policies), "budgets": [str(b) for b in cfg.budgets],
                   "rates_rps": list(cfg.rates), "duration_s": cfg.duration_s, "slo_scale": cfg.slo_scale,
                   "seed": cfg.seed, "trace": str(cfg.trace) if cfg.trace else None, "mix": cfg.mix,
                   "model": cfg.model, "target": str(cfg.target), "draft": str(cfg.draft),
                   # every setting that shaped the numbers besides the above
                   "dtype": str(shared.target.dtype).removeprefix("torch."), "torch_threads": torch.get_num_threads(),
                   "d_max": EngineConfig().adaptive.d_max, "w_max": EngineConfig().adaptive.w_max,
                   "max_tokens_cap": cfg.max_tokens_cap, "max_prompt_tokens": cfg.max_prompt_tokens,
                   "kv_memory_mb": cfg.kv_memory_mb, "chat_template": has_chat_template(shared.tokenizer)},
        "results": rows,
        "adaserve_vs_best_other": ratios,
    }


def plot_report(report: dict, path: Path) -> None:
    """SLO attainment and goodput against rate, one line per policy (like AdaServe Figures 8-9)."""
    from adaserve.plots import panels

    with panels(path, 2) as (fig, (ax1, ax2)):
        _draw_report(report, fig, ax1, ax2)


def _draw_report(report: dict, fig: Any, ax1: Any, ax2: Any) -> None:
    for label in dict.fromkeys(r["policy"] for r in report["results"]):
        rows = sorted((r for r in report["results"] if r["policy"] == label), key=lambda r: r["rate_rps"])
        rates = [r["rate_rps"] for r in rows]
        style = {"linewidth": 2.5} if label == "adaserve" else {"linewidth": 1.2}
        ax1.plot(rates, [100 * r["slo_attainment"] for r in rows], "o-", label=label, **style)
        ax2.plot(rates, [r["goodput_tok_s"] for r in rows], "o-", label=label, **style)
    ax1.set(xlabel="request rate (req/s)", ylabel="SLO attainment (%)", ylim=(0, 105), title="SLO attainment")
    ax2.set(xlabel="request rate (req/s)", ylabel="goodput (tokens/s)", title="Goodput")
    ax1.legend(fontsize=8)
    name = report["config"].get("model") or Path(report["config"]["target"]).name
    fig.suptitle(f"{name} on {report['device'][:50]}", fontsize=9)
