"""The replay clock against the real engine for tree schedules, per system string: accepted tokens per
verification and makespan on tests/bench/sim/test_replay.py's 12-request workload (demo pair, simulated clock,
artifact/llama-3.1-70b). Prints JSON. Used for the beam-width check of issue 29 (docs/benchmarks.md).

Usage: PYTHONPATH=. .venv/bin/python scripts/replay-tree-crosscheck.py [--prefill-rule fixed|slo] SYSTEM ...
"""

from __future__ import annotations

import argparse
import json

import numpy as np

from tests.bench.sim.test_replay import real_run, replay_run, settings


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("systems", nargs="+")
    ap.add_argument("--prefill-rule", default="fixed", choices=["fixed", "slo"])
    args = ap.parse_args()
    rows = []
    for system in args.systems:
        s = settings(prefill_rule=args.prefill_rule)
        real, rep = real_run(system, s), replay_run(system, s)
        acc_real = float(np.mean([a for r in real for a in r.metrics.accepted_per_step]))
        acc_rep = float(np.mean([a for r in rep for a in r.accepted_per_step]))
        rows.append({"system": system, "prefill_rule": args.prefill_rule, "accepted_real": acc_real,
                     "accepted_replay": acc_rep, "replay_over_real": acc_rep / acc_real,
                     "makespan_real_s": max(r.metrics.last_token_s or 0.0 for r in real),
                     "makespan_replay_s": max(r.last_s or 0.0 for r in rep)})
    print(json.dumps({"workload": "tests/bench/sim/test_replay.py WORKLOAD (12 requests, 40 tokens)", "rows": rows},
                     indent=1))


if __name__ == "__main__":
    main()
