"""Which tree shapes the engine drafted in one wall-clock bench cell, iteration by iteration.

    python scripts/shape-trace.py --policy adaserve+ours --rate 1 --seed 1 [--duration 30] --json OUT

The bench's own workload for that (rate, seed) on the demo pair (`adaserve bench --model demo-tiny`, the
baseline TPOT pinned as in docs/benchmarks.md's wall-clock runs), served on the wall clock by one engine built
as the bench builds it (this machine's profile and tree bounds), with a step listener: per iteration the
requests decoding, the (depth, width) drafted ((0, 0): plain decoding), and the learnt rank-0 rate. The JSON
holds the shape counts, the runs of plain decoding, the requests' mean TPOT and the first iterations; and, for the
iterations without prefill, by (requests decoding, capped at 4; depth): how many, their mean wall time (the engine's
own clock, as ``StepMetrics.t_wall_s``), predicted time, tokens verified and emitted per request, and the whole
run's decode-only milliseconds per emitted token; beside them the iterations that carried prefill (count, wall time,
and by depth: their mean wall time, prompt tokens, requests decoding, tokens verified and emitted).
The baseline TPOT is this machine's pinned one with ``--baseline-tpot-ms``.
"""

from __future__ import annotations

import argparse
import collections
import json
from pathlib import Path

from adaserve.bench.runner import BenchConfig, load_shared, make_engine, named_variant, serve, sweep_points, to_requests
from adaserve.engine.engine import StepMetrics
from adaserve.engine.loading.catalog import resolve

BASELINE_TPOT_MS = 1.9645890425530805  # the wall-clock runs' pinned baseline (docs/benchmarks.md)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--policy", default="adaserve+ours")
    p.add_argument("--rate", type=float, required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--duration", type=float, default=30.0)
    p.add_argument("--json", type=Path, required=True)
    p.add_argument("--baseline-tpot-ms", type=float, default=BASELINE_TPOT_MS)
    a = p.parse_args()
    pair = resolve("demo-tiny")
    cfg = BenchConfig(target=pair.target, draft=pair.draft, policies=(a.policy,), rates=(a.rate,),
                      duration_s=a.duration, baseline_tpot_ms=a.baseline_tpot_ms, seed=a.seed)
    shared = load_shared(cfg, progress=False)
    eng = make_engine(shared, named_variant(a.policy, shared.budget))
    rows: list[tuple[int, int, int, float | None]] = []
    steps: list[StepMetrics] = []

    def on_step(m: StepMetrics) -> None:
        rates = eng.acceptance.rank_rates(1) if eng.acceptance is not None else None
        rows.append((m.n_decode, m.depth, m.width, None if rates is None else round(rates[0], 3)))
        steps.append(m)

    eng.step_listeners.append(on_step)
    point = sweep_points(cfg, a.baseline_tpot_ms)[0]
    arrivals = to_requests(point.requests(), shared, cfg)
    serve(shared, eng, arrivals)
    decoding = [r for r in rows if r[0] > 0]
    runs, last, start = [], None, 0
    for i, r in enumerate([*decoding, (0, -1, -1, None)]):
        plain = r[1] == 0
        if last is not None and plain != last:
            if last:
                runs.append({"from_iteration": start, "iterations": i - start})
            start = i
        last = plain
    reqs = [r for _, r in arrivals if r.metrics.first_token_s is not None and len(r.output_ids) > 1]
    tpot = [(r.metrics.last_token_s - r.metrics.first_token_s) / (len(r.output_ids) - 1) * 1e3 for r in reqs]
    report = {
        "command": f"python scripts/shape-trace.py --policy {a.policy} --rate {a.rate:g} --seed {a.seed} "
                   f"--duration {a.duration:g} --baseline-tpot-ms {a.baseline_tpot_ms!r}",
        "adaptive": vars(eng.policy.adaptive) if hasattr(eng.policy, "adaptive") else None,
        "iterations": len(decoding),
        "shapes": {f"{d},{w}": n for (d, w), n in collections.Counter((r[1], r[2]) for r in decoding).most_common()},
        "plain_runs": runs,
        "mean_tpot_ms": sum(tpot) / len(tpot) if tpot else None,
        "first_iterations": [{"decoding": n, "depth": d, "width": w, "rank0_rate": r} for n, d, w, r in decoding[:40]],
        **cost_by_shape(steps),
    }
    a.json.write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps({k: report[k] for k in ("iterations", "shapes", "plain_runs", "mean_tpot_ms",
                                             "decode_ms_per_token")}))


def cost_by_shape(steps: list[StepMetrics]) -> dict:
    """Decode-only iterations by (requests decoding, capped at 4; depth): count, mean wall and predicted ms,
    tokens verified (roots included) and emitted per request; their ms per emitted token over the run; the prefill
    iterations' count and time, and by depth."""
    decode = [m for m in steps if m.n_decode > 0 and m.n_prefill == 0]
    groups: dict[tuple[int, int], list[StepMetrics]] = collections.defaultdict(list)
    for m in decode:
        groups[(min(m.n_decode, 4), m.depth)].append(m)
    by_shape = [{"decoding": n, "depth": d, "iterations": len(ms),
                 "wall_ms": round(1e3 * sum(m.t_wall_s for m in ms) / len(ms), 3),
                 "predicted_ms": round(1e3 * sum(m.predicted_iter_s for m in ms) / len(ms), 3),
                 "emitted_per_request": round(sum(m.tokens_emitted / m.n_decode for m in ms) / len(ms), 3),
                 "verified_per_request": round(sum(m.tokens_verified / m.n_decode for m in ms) / len(ms), 3)}
                for (n, d), ms in sorted(groups.items())]
    prefill = [m for m in steps if m.n_prefill > 0]
    emitted = sum(m.tokens_emitted for m in decode)
    prefill_ms = round(1e3 * sum(m.t_wall_s for m in prefill), 1)
    by_depth: dict[int, list[StepMetrics]] = collections.defaultdict(list)
    for m in prefill:
        by_depth[m.depth].append(m)
    prefill_by_depth = [{"depth": d, "iterations": len(ms),
                         "wall_ms": round(1e3 * sum(m.t_wall_s for m in ms) / len(ms), 3),
                         "prompt_tokens": round(sum(m.prefill_tokens for m in ms) / len(ms), 1),
                         "decoding": round(sum(m.n_decode for m in ms) / len(ms), 2),
                         "verified": round(sum(m.tokens_verified for m in ms) / len(ms), 2),
                         "emitted": round(sum(m.tokens_emitted for m in ms) / len(ms), 2)}
                        for d, ms in sorted(by_depth.items())]
    return {"decode_ms_per_token": round(1e3 * sum(m.t_wall_s for m in decode) / emitted, 4) if emitted else None,
            "prefill_iterations": {"iterations": len(prefill), "wall_ms": prefill_ms, "by_depth": prefill_by_depth},
            "by_shape": by_shape}


if __name__ == "__main__":
    main()
