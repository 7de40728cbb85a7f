"""Trace adaserve's selection in a simulated overload: what the engine thought its trees were worth
(f-mass of the verified tree) against what verification accepted, per iteration sample and overall.

    python scripts/selection-trace.py --node-value draft|learned [--rate 20] [--duration 6] [--max-batch 64] --json OUT

Also what an iteration carried (prefill tokens beside the trees, simulated step time) and each class's
TPOT against its target: where the time of an overloaded iteration goes.

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
from adaserve.engine.acceptance import RankAcceptance
from adaserve.engine.catalog import resolve
from adaserve.engine.engine import Engine

PROFILE = "a100-80g-tp4/llama-3.1-70b"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--node-value", choices=["draft", "learned"], required=True)
    p.add_argument("--rate", type=float, default=20.0)
    p.add_argument("--duration", type=float, default=6.0)
    p.add_argument("--max-batch", type=int, default=64)
    p.add_argument("--json", type=Path, required=True)
    a = p.parse_args()
    pair = resolve("demo-tiny")
    cfg = BenchConfig(target=pair.target, draft=pair.draft, policies=("adaserve",), rates=(a.rate,),
                      duration_s=a.duration, clock="simulated", device_profile=PROFILE, max_batch=a.max_batch)
    shared = load_shared(cfg, progress=False)
    base = make_engine(shared, Variant("adaserve", "adaserve", shared.budget))
    eng = Engine(base.target, base.draft, replace(base.cfg, node_value=a.node_value), clock=base.clock)
    records, steps = [], []
    eng.selection_listeners.append(records.append)
    eng.step_listeners.append(steps.append)
    wl = build_workload(WorkloadConfig(a.rate, a.duration, baseline_tpot_ms=25.24, seed=0))
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
                      f"--duration {a.duration:g} --max-batch {a.max_batch}",
           "device_profile": PROFILE, "model": "demo-tiny", "node_value": a.node_value, "rate_rps": a.rate,
           "duration_s": a.duration, "iterations": len(steps),
           "mean_believed_tokens_per_tree": float(np.mean(believed)) if believed else None,
           "mean_emitted_tokens_per_tree": float(np.mean(acc + 1)) if len(acc) else None,
           "mean_accepted_per_verification": float(acc.mean()) if len(acc) else None,
           "mean_decoding_requests": float(np.mean([m.n_decode for m in steps if m.n_decode])),
           "accepted_by_verified_size": buckets,
           "iteration_carried": carried, "by_tpot_target": classes, "learnt_acceptance_by_sibling_rank": learnt}
    a.json.write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
