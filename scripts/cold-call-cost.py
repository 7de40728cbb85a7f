"""What one library call costs right after the CPU's caches were swept, against the same call warm (issue 30).

The engine's host work runs between forwards, and a forward streams the model's weights through the caches (demo-tiny's
float32 target: ~22 MB). This script calls a few of the entry points the host path uses (``torch.from_numpy``,
``np.concatenate``, a tensor slice, a ``numpy`` slice's ``reshape``) once after reading a float32 array of each
``--sizes`` MB (a stand-in for the forward's traffic; 0: no sweep, the warm call), ``--trials`` times, and prints
JSON: per size, each call's median microseconds.

    PYTHONPATH=. python scripts/cold-call-cost.py --sizes 0,1,4,8,16,32 --trials 300

What it says about the engine: a call's warm cost is not what it costs in an iteration when the forwards between the
calls evict what it touches; a smaller model (int4 weights) evicts less.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch

from adaserve.bench.engine_only import host_cpu


def calls() -> dict[str, Callable[[], object]]:
    a = np.arange(100)
    t = torch.arange(100)
    return {
        "torch.from_numpy": lambda: torch.from_numpy(a),
        "np.concatenate": lambda: np.concatenate([a, a]),
        "tensor[1:3]": lambda: t[1:3],
        "ndarray.reshape": lambda: a[:50].reshape(5, 10),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="0,1,4,8,16,32", help="MB read before each call, comma-separated (0: none)")
    ap.add_argument("--trials", type=int, default=300)
    args = ap.parse_args()
    try:
        sizes = [float(s) for s in args.sizes.split(",") if s]
    except ValueError:
        ap.error(f"--sizes: numbers of MB, comma-separated, got {args.sizes!r}")
    if not sizes or min(sizes) < 0 or args.trials < 1:
        ap.error("--sizes needs at least one size >= 0 and --trials at least 1")
    torch.set_num_threads(1)
    fns = calls()
    out: dict[str, dict[str, float]] = {}
    for mb in sizes:
        sweep = np.ones(int(mb * (1 << 20)) // 4, np.float32) if mb > 0 else None
        us: dict[str, list[float]] = {name: [] for name in fns}
        for _ in range(args.trials):
            for name, fn in fns.items():
                if sweep is not None:
                    sweep.sum()
                t0 = time.perf_counter()
                fn()
                us[name].append((time.perf_counter() - t0) * 1e6)
        out[f"{mb:g}"] = {name: round(statistics.median(v), 2) for name, v in us.items()}
    print(json.dumps({"benchmark": "cold-call-cost", "cpu": host_cpu(), "trials": args.trials,
                      "us_median_by_sweep_mb": out}, indent=1))


if __name__ == "__main__":
    main()
