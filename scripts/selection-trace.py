"""Trace adaserve's selection in a simulated overload: what the engine thought its trees were worth
(f-mass of the verified tree) against what verification accepted, per iteration sample and overall.

    python scripts/selection-trace.py --node-value draft|learned [--rate 20] [--duration 6] [--max-batch 64]
        [--prefill-rule fixed|slo] [--max-tokens 128] [--max-prompt-tokens 512] --json OUT [--plot PNG]

Also what an iteration carried (prefill tokens beside the trees, simulated step time) and each class's
TPOT against its target: where the time of an overloaded iteration goes; and a timeline in simulated
time (half-second bins): requests decoding, requests still waiting for their first token, prompt
tokens per iteration. ``--plot`` draws that timeline.

The tiny pair on the simulated A100 profile of the paper's setting (docs/architecture.md §5, §13).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

import numpy as np

from adaserve.bench.runner import BenchConfig, Variant, load_shared, make_engine, serve, to_requests
from adaserve.bench.workload import WorkloadConfig, build_workload
from adaserve.engine.engine import Engine
from adaserve.engine.loading.catalog import resolve
from adaserve.engine.speculation.acceptance import RankAcceptance

PROFILE = "a100-80g-tp4/llama-3.1-70b"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--node-value", choices=["draft", "learned"], required=True)
    p.add_argument("--rate", type=float, default=20.0)
    p.add_argument("--duration", type=float, default=6.0)
    p.add_argument("--max-batch", type=int, default=64)
    p.add_argument("--prefill-rule", choices=["fixed", "slo"], default="fixed")
    p.add_argument("--max-tokens", type=int, default=BenchConfig.max_tokens_cap)
    p.add_argument("--max-prompt-tokens", type=int, default=BenchConfig.max_prompt_tokens)
    p.add_argument("--json", type=Path, required=True)
    p.add_argument("--plot", type=Path)
    a = p.parse_args()
    pair = resolve("demo-tiny")
    cfg = BenchConfig(target=pair.target, draft=pair.draft, policies=("adaserve",), rates=(a.rate,),
                      duration_s=a.duration, clock="simulated", device_profile=PROFILE, max_batch=a.max_batch,
                      prefill_rule=a.prefill_rule, max_tokens_cap=a.max_tokens, max_prompt_tokens=a.max_prompt_tokens)
    shared = load_shared(cfg, progress=False)
    base = make_engine(shared, Variant("adaserve", "adaserve", shared.budget))
    eng = Engine(base.target, base.draft, replace(base.cfg, node_value=a.node_value), clock=base.clock)
    records, steps, times = [], [], []
    eng.selection_listeners.append(records.append)
    eng.step_listeners.append(steps.append)
    eng.step_listeners.append(lambda _: times.append(eng.clock()))  # simulated seconds at the step's end
    wl = build_workload(WorkloadConfig(a.rate, a.duration, baseline_tpot_ms=25.24, seed=0, max_tokens_cap=a.max_tokens))
    arrivals = to_requests(wl, shared, cfg)
    serve(shared, eng, arrivals)
    # the value the engine gave each verified tree: sum of f over the kept nodes, bonus (root) included
    believed = [float(np.exp(c.log_probs[s]).sum()) for r in records for c, s in zip(r.candidates, r.selected,
                                                                                           strict=True)]
    accepted = [x for _, q in arrivals for x in q.metrics.accepted_per_step]
    verified = np.array([v for _, q in arrivals for v in q.metrics.verified_per_step])
    acc = np.array(accepted)
    buckets = {}
    for lo, hi in ((1, 1), (2, 5), (6, 10), (11, 20), (21, 999)):
        sel = (verified >= lo) & (verified <= hi)
        mean = float(acc[sel].mean()) if sel.any() else None
        buckets[f"{lo}-{hi}"] = {"steps": int(sel.sum()), "mean_accepted": mean}
    by_class: dict[str, dict] = {}
    for _, q in arrivals:
        t, slo = q.metrics.tpot_ms, q.tpot_slo_ms
        c = by_class.setdefault(f"{slo:.1f} ms", {"requests": 0, "met": 0, "tpot_ms": []})
        c["requests"] += 1
        c["met"] += t is None or t <= slo
        if t is not None:
            c["tpot_ms"].append(t)
    classes = {k: {"requests": v["requests"], "attainment": v["met"] / v["requests"],
                   "tpot_ms_p50_p90": [float(np.percentile(v["tpot_ms"], q)) for q in (50, 90)]}
               for k, v in sorted(by_class.items())}
    spec = [m for m in steps if m.n_decode]
    carried = {"iterations_with_prefill_share": float(np.mean([m.prefill_tokens > 0 for m in spec])),
               "mean_prefill_tokens": float(np.mean([m.prefill_tokens for m in spec])),
               "mean_verified_tokens": float(np.mean([m.tokens_verified for m in spec])),
               "mean_budget": float(np.mean([m.budget for m in spec])),
               "mean_step_ms": float(1e3 * np.mean([m.t_step_s for m in spec])),
               "mean_predicted_step_ms": float(1e3 * np.mean([m.predicted_iter_s for m in spec]))}
    learnt = eng.acceptance.rates() if isinstance(eng.acceptance, RankAcceptance) else None
    out = {"command": f"python scripts/selection-trace.py --node-value {a.node_value} --rate {a.rate:g} "
                      f"--duration {a.duration:g} --max-batch {a.max_batch} --prefill-rule {a.prefill_rule} "
                      f"--max-tokens {a.max_tokens} --max-prompt-tokens {a.max_prompt_tokens}",
           "prefill_rule": a.prefill_rule, "max_tokens": a.max_tokens, "max_prompt_tokens": a.max_prompt_tokens,
           "device_profile": PROFILE, "model": "demo-tiny", "node_value": a.node_value, "rate_rps": a.rate,
           "duration_s": a.duration, "iterations": len(steps),
           "mean_believed_tokens_per_tree": float(np.mean(believed)) if believed else None,
           "mean_emitted_tokens_per_tree": float(np.mean(acc + 1)) if len(acc) else None,
           "mean_accepted_per_verification": float(acc.mean()) if len(acc) else None,
           "mean_decoding_requests": float(np.mean([m.n_decode for m in steps if m.n_decode])),
           "accepted_by_verified_size": buckets,
           "iteration_carried": carried, "by_tpot_target": classes, "learnt_acceptance_by_sibling_rank": learnt,
           "timeline": timeline(steps, times, [q.metrics for _, q in arrivals])}
    a.json.write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps({k: v for k, v in out.items() if k != "timeline"}, indent=2))
    if a.plot:
        plot(out, a.plot)


def timeline(steps: list, times: list[float], metrics: list, bin_s: float = 0.5) -> list[dict]:
    """Per half-second of simulated time: mean requests decoding and prompt tokens per iteration, and the
    requests that had arrived but not yet had their first token at the bin's end."""
    end = max(times) if times else 0.0
    rows = []
    for i in range(int(end / bin_s) + 1):
        lo, hi = i * bin_s, (i + 1) * bin_s
        inside = [m for m, t in zip(steps, times, strict=True) if lo <= t < hi]
        waiting = sum(1 for m in metrics if m.arrival_s <= hi and (m.first_token_s is None or m.first_token_s > hi))
        rows.append({"t_s": hi, "iterations": len(inside), "waiting_first_token": waiting,
                     "mean_decoding": float(np.mean([m.n_decode for m in inside])) if inside else 0.0,
                     "mean_prefill_tokens": float(np.mean([m.prefill_tokens for m in inside])) if inside else 0.0})
    return rows


def plot(out: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = out["timeline"]
    t = [r["t_s"] for r in rows]
    fig, ax = plt.subplots(2, 1, figsize=(8, 5.5), sharex=True)
    ax[0].plot(t, [r["mean_decoding"] for r in rows], label="requests decoding (mean per iteration)")
    ax[0].plot(t, [r["waiting_first_token"] for r in rows], label="requests waiting for their first token")
    ax[0].set_ylabel("requests")
    ax[0].legend(fontsize=8)
    ax[1].plot(t, [r["mean_prefill_tokens"] for r in rows], color="tab:green")
    ax[1].set_ylabel("prompt tokens / iteration")
    ax[1].set_xlabel("simulated time (s)")
    fig.suptitle(f"adaserve, {out['rate_rps']:g} req/s for {out['duration_s']:g} s, prefill rule "
                 f"{out['prefill_rule']} ({out['device_profile']}, simulated)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
