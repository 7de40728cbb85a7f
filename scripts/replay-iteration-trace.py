"""Per-iteration trace of systems on the replay clock: who misses, what they asked for and what they got.

    PYTHONPATH=. .venv/bin/python scripts/replay-iteration-trace.py --pool POOL --trace-json TRACE \\
        --systems "adaserve+ours,chain:4" [--seed 0] [--max-batch 64] [--prefill-chunk 1024] \\
        [--prefill-rule slo] --json OUT

Runs each system as one ``adaserve replay run`` cell (bench/replay_sweep.py, same settings) with listeners on
the replay engine (sim/replay.py: ``step_listeners`` per iteration, ``selection_listeners`` per selection) and
reports, per system:

- per class: attainment, TPOT / target quantiles, TTFT and its two parts (queue: arrival to a running slot;
  prefill: slot to first token);
- per class, over request-iterations: A(r) as selection saw it (without the SLO margin), verified tree
  size, tokens emitted (accepted + bonus) against what selection believed the tree worth (its nodes'
  values, learnt or the draft's: the calibration), and how often a request emitted at least its A(r);
- per iteration: decoding requests, requests prefilling and waiting, prompt tokens, verified tokens, budget,
  the SLO phase's value floor, depth, width, iteration seconds (mean and quantiles), split by whether prompt
  tokens rode along;
- requests of the first system that missed where another system met them, with both systems' per-request
  figures (the "who loses what" view);
- per system, every request that missed its TPOT target (id, class, TPOT over target), and with
  ``--timeline ID,...`` those requests' iterations one by one: when, the tree's depth and width, requests decoding,
  A(r) with the SLO margin as selection saw it, verified tree size, tokens emitted, the tree's believed value,
  prompt tokens in the forward, the iteration's milliseconds and the budget.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np

from adaserve.bench.emission_trace import read_emission_trace
from adaserve.bench.replay_sweep import SweepSettings, engine_config, replay_requests
from adaserve.bench.sim.agreement import AgreementPool
from adaserve.bench.sim.device_model import load_profile_file
from adaserve.bench.sim.replay import ReplayEngine, ReplayRequest


def quantiles(xs: list[float] | np.ndarray) -> dict[str, float] | None:
    a = np.asarray(xs, float)
    if not len(a):
        return None
    q = np.quantile(a, [0.1, 0.5, 0.9])
    return {"mean": float(a.mean()), "p10": float(q[0]), "p50": float(q[1]), "p90": float(q[2])}


def run(system: str, trace_path: Path, s: SweepSettings, seed: int) -> tuple[list[ReplayRequest], dict[str, Any]]:
    trace = read_emission_trace(trace_path)
    pool = AgreementPool.load(Path(s.pool))
    device = load_profile_file(s.device_profile)
    cfg = engine_config(system, device, s)
    reqs = replay_requests(trace, pool, baseline_tpot_ms=s.baseline_tpot_ms, seed=seed,
                           prompt_lengths=s.prompt_lengths)
    eng = ReplayEngine(cfg, device, cfg.target_cost, cfg.draft_cost, seed=seed,  # type: ignore[arg-type]
                       kv_tokens=s.kv_tokens)
    steps: list[dict] = []
    sels: list[dict] = []
    eng.step_listeners.append(steps.append)
    eng.selection_listeners.append(sels.append)
    eng.run(reqs)
    config = {"budget": cfg.budget, "budget_rule": cfg.budget_rule, "prefill_rule": cfg.prefill_rule,
              "slo_margin": cfg.slo_margin, "slo_floor": cfg.slo_floor, "tree": vars(cfg.adaptive)}
    return reqs, {"steps": steps, "selections": sels, "config": config}


def timeline(rid: str, trace: dict[str, Any]) -> list[dict[str, Any]]:
    """Request ``rid``'s iterations, one row each (module docstring)."""
    steps = {st["t_start"]: st for st in trace["steps"]}
    rows = []
    for sel in trace["selections"]:
        if rid not in sel["ids"]:
            continue
        i = sel["ids"].index(rid)
        st = steps.get(sel["t_start"], {})
        rows.append({"t_s": round(sel["t_start"], 4), "depth": sel["depth"], "width": sel["width"],
                     "n_decode": len(sel["ids"]), "need": round(sel["needs"][i], 2), "size": sel["sizes"][i],
                     "emitted": sel["accepted"][i] + 1, "believed": round(sel["believed"][i], 2),
                     "prefill_tokens": st.get("prefill_tokens"),
                     "iteration_ms": round(1e3 * (st.get("t_draft", 0.0) + st.get("t_target", 0.0)), 1),
                     "budget": sel["budget"]})
    return rows


def met(r: ReplayRequest) -> bool:
    return r.tpot_slo_ms is None or r.tpot_ms is None or r.tpot_ms <= r.tpot_slo_ms


def summarise(reqs: list[ReplayRequest], trace: dict[str, Any]) -> dict[str, Any]:
    by_id = {r.request_id: r for r in reqs}
    margin = trace["config"]["slo_margin"]
    classes = sorted({r.slo_class for r in reqs})
    per_class: dict[str, Any] = {}
    ri = defaultdict(lambda: defaultdict(list))  # class -> field -> values over request-iterations
    per_req = defaultdict(lambda: defaultdict(list))  # request -> field -> values
    for sel in trace["selections"]:
        for rid, need, size, acc, val in zip(sel["ids"], sel["needs"], sel["sizes"], sel["accepted"], sel["believed"],
                                             strict=True):
            c = by_id[rid].slo_class
            a = need - margin if need else need
            ri[c]["need"].append(a)
            ri[c]["size"].append(size)
            ri[c]["emitted"].append(acc + 1)
            ri[c]["believed"].append(val)
            ri[c]["made"].append(acc + 1 >= a)
            per_req[rid]["size"].append(size)
            per_req[rid]["emitted"].append(acc + 1)
            per_req[rid]["depth"].append(sel["depth"])
    for c in classes:
        rs = [r for r in reqs if r.slo_class == c]
        per_class[c] = {
            "requests": len(rs), "tpot_slo_ms": rs[0].tpot_slo_ms,
            "attainment": float(np.mean([met(r) for r in rs])),
            "tpot_over_target": quantiles([r.tpot_ms / r.tpot_slo_ms for r in rs if r.tpot_ms and r.tpot_slo_ms]),
            "ttft_s": quantiles([r.ttft_ms / 1e3 for r in rs if r.ttft_ms is not None]),
            "queue_s": quantiles([r.admitted_s - r.arrival_s for r in rs if r.admitted_s is not None]),
            "prefill_s": quantiles([r.first_s - r.admitted_s for r in rs if r.admitted_s is not None and r.first_s]),
            "iter_need": quantiles(ri[c]["need"]), "iter_tree_size": quantiles(ri[c]["size"]),
            "iter_emitted": quantiles(ri[c]["emitted"]),
            "iter_believed": quantiles(ri[c]["believed"]),  # the verified tree's value to selection: calibration
            "iter_emitted_at_least_need": float(np.mean(ri[c]["made"])) if ri[c]["made"] else None,
        }
    steps = trace["steps"]
    dec = [st for st in steps if st["n_decode"]]
    sel_by_t = {s["t_start"]: s for s in trace["selections"]}

    def counts(xs: list[int]) -> dict[str, int]:
        return {str(v): int(k) for v, k in zip(*np.unique(xs, return_counts=True), strict=True)} if xs else {}

    def iters(group: list[dict]) -> dict[str, Any]:
        dur = [st["t_draft"] + st["t_target"] for st in group]
        shapes = [sel_by_t[st["t_start"]] for st in group if st["t_start"] in sel_by_t]
        emitted = sum(st["accepted"] for st in group) / max(1, sum(st["n_decode"] for st in group))
        return {"iterations": len(group), "seconds": quantiles(dur),
                "n_decode": quantiles([st["n_decode"] for st in group]),
                "prefill_tokens": quantiles([st["prefill_tokens"] for st in group]),
                "n_prefill": quantiles([st["n_prefill"] for st in group]),
                "n_waiting": quantiles([st["n_waiting"] for st in group]),
                "verified": quantiles([st["verified"] for st in group]),
                "accepted_per_request": float(emitted),
                "budget": quantiles([s["budget"] for s in shapes]),
                "slo_floor": quantiles([s.get("min_value", 0.0) for s in shapes]),
                "depth": counts([s["depth"] for s in shapes]), "width": counts([s["width"] for s in shapes])}

    return {"config": trace["config"], "per_class": per_class,
            "decode_iterations": iters(dec),
            "decode_iterations_with_prefill": iters([st for st in dec if st["prefill_tokens"]]),
            "decode_iterations_without_prefill": iters([st for st in dec if not st["prefill_tokens"]]),
            "per_request": {rid: {k: float(np.mean(v)) for k, v in f.items()} for rid, f in per_req.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pool", required=True, type=Path)
    ap.add_argument("--trace-json", required=True, type=Path)
    ap.add_argument("--systems", required=True, help="comma-separated, as `adaserve replay run --systems`")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-batch", type=int, default=64)
    ap.add_argument("--prefill-chunk", type=int, default=1024)
    ap.add_argument("--prefill-rule", default="slo", choices=["fixed", "slo"])
    ap.add_argument("--json", type=Path, required=True)
    ap.add_argument("--timeline", default="", help="comma-separated request ids: their iterations one by one")
    a = ap.parse_args()
    s = SweepSettings(pool=str(a.pool), max_batch=a.max_batch, prefill_chunk=a.prefill_chunk,
                      prefill_rule=a.prefill_rule)
    systems = [x for x in a.systems.split(",") if x]
    out: dict[str, Any] = {"trace": a.trace_json.name, "trace_sha256": read_emission_trace(a.trace_json).sha256,
                           "seed": a.seed, "settings": vars(s), "systems": {}}
    runs = {}
    for system in systems:
        reqs, trace = run(system, a.trace_json, s, a.seed)
        runs[system] = reqs
        out["systems"][system] = summarise(reqs, trace)
        out["systems"][system]["missed"] = [
            {"id": r.request_id, "class": r.slo_class, "tpot_over_target": round(r.tpot_ms / r.tpot_slo_ms, 4)}
            for r in reqs if not met(r)]
        wanted = [x for x in a.timeline.split(",") if x]
        if wanted:
            out["systems"][system]["timelines"] = {rid: timeline(rid, trace) for rid in wanted}
    first, *others = systems
    lost = {}
    for other in others:
        mine = {r.request_id: r for r in runs[first]}
        theirs = {r.request_id: r for r in runs[other]}
        rows = [rid for rid in mine if not met(mine[rid]) and met(theirs[rid])]
        won = [rid for rid in mine if met(mine[rid]) and not met(theirs[rid])]
        by_class: dict[str, Any] = {}
        for c in sorted({mine[rid].slo_class for rid in rows}):
            ids = [rid for rid in rows if mine[rid].slo_class == c]

            def view(system: str, ids: list[str] = ids, rq: dict = mine) -> dict[str, Any]:
                pr = out["systems"][system]["per_request"]
                reqs_ = {r.request_id: r for r in runs[system]}
                return {"tpot_over_target": quantiles([reqs_[i].tpot_ms / reqs_[i].tpot_slo_ms for i in ids]),
                        "ttft_s": quantiles([reqs_[i].ttft_ms / 1e3 for i in ids]),
                        "tree_size": quantiles([pr[i]["size"] for i in ids if i in pr]),
                        "emitted": quantiles([pr[i]["emitted"] for i in ids if i in pr]),
                        "depth": quantiles([pr[i]["depth"] for i in ids if i in pr])}

            by_class[c] = {"requests": len(ids), first: view(first), other: view(other)}
        lost[other] = {"missed_by_first_met_by_other": len(rows), "met_by_first_missed_by_other": len(won),
                       "by_class": by_class}
    out["against_first"] = lost
    for sysname in systems:  # the per-request table is for the comparison; too long to keep
        out["systems"][sysname].pop("per_request")
    a.json.write_text(json.dumps(out, indent=1))
    print(json.dumps({k: {c: round(v["attainment"], 3) for c, v in o["per_class"].items()}
                      for k, o in out["systems"].items()}))


if __name__ == "__main__":
    main()
