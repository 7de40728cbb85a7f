"""One beam level's picks on a CPU: ``torch.topk`` against ``top_k_indices``' blocked pass (issue 30).

Times ``beam_ops.expand_on_device`` (a level's picks, their log-probabilities and the finiteness check) and the top-k
alone, over frontier shapes [n requests, F nodes, V vocabulary] and k picks per node, with random logits,
warm caches and one torch thread. Prints JSON (median microseconds of ``--repeats`` runs of ``--calls`` calls).

    PYTHONPATH=. python scripts/level-picks-bench.py > docs/results/level-picks-cpu-<machine>.json

``--cpu-kernels``: the CPU kernels' calls instead (native/picks.c, through ``NativeKernels``): ``beam_picks`` (a
level's k picks per row and a request's top k of them) and ``first_argmax`` (the greedy draws) over the same rows.
For a paired comparison run it with ``PYTHONPATH=WORKTREE`` against another commit's kernels.
"""

from __future__ import annotations

import argparse
import functools
import json
import platform
import statistics
import time
from collections.abc import Callable
from unittest import mock

import torch

from adaserve.bench.engine_only import host_cpu, source_version
from adaserve.engine.model import native_kernels
from adaserve.engine.speculation import beam_ops, verify

SHAPES = [(1, 2, 4096), (8, 2, 4096), (32, 2, 4096), (1, 2, 49152), (8, 2, 49152), (32, 2, 49152), (32, 4, 49152)]


def per_call_us(fn: Callable[[], object], calls: int, repeats: int) -> float:
    fn()
    runs = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        runs.append((time.perf_counter() - t0) / calls * 1e6)
    return statistics.median(runs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=50)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--k", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--cpu-kernels", action="store_true", help="time the CPU kernels' beam_picks and first_argmax")
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.cpu_kernels:
        kernels_report(args)
        return
    gen = torch.Generator().manual_seed(0)
    rows = []
    for n, f, v in SHAPES:
        x = torch.randn(n * f, v, generator=gen)
        base = torch.randn(n, f, dtype=torch.float64, generator=gen)
        for k in args.k:
            level = functools.partial(beam_ops.expand_on_device, x, base, width=k, frontier=1,
                                      kernels=native_kernels.chosen())
            picks = functools.partial(verify.top_k_indices, x.view(n, f, v), k)
            blocked = (per_call_us(level, args.calls, args.repeats), per_call_us(picks, args.calls, args.repeats))
            # the same calls with the blocked pass switched off: torch.topk's scalar pass over every row
            with mock.patch.object(verify, "TOPK_BLOCKED_MIN", 1 << 62):
                plain = (per_call_us(level, args.calls, args.repeats), per_call_us(picks, args.calls, args.repeats))
            rows.append({"n": n, "frontier": f, "vocab": v, "k": k,
                         "level_us_topk": round(plain[0], 1), "level_us_blocked": round(blocked[0], 1),
                         "picks_us_topk": round(plain[1], 1), "picks_us_blocked": round(blocked[1], 1),
                         "level_speedup": round(plain[0] / blocked[0], 2)})
    print(json.dumps({"benchmark": "level-picks", "source": source_version(), "cpu": host_cpu(),
                      "python": platform.python_version(), "torch": torch.__version__, "threads": 1,
                      "calls": args.calls, "repeats": args.repeats,
                      "blocked_min_logits": verify.TOPK_BLOCKED_MIN, "rows": rows}, indent=2))


def kernels_report(args: argparse.Namespace) -> None:
    """``--cpu-kernels``: per shape and k, microseconds a call of ``beam_picks`` and of ``first_argmax``."""
    kernels = native_kernels.chosen()
    if kernels is None:
        raise SystemExit("level-picks-bench: the CPU kernels did not load here (ADASERVE_NATIVE_KERNELS, a compiler)")
    gen = torch.Generator().manual_seed(0)
    rows = []
    for n, f, v in SHAPES:
        x = 3 * torch.randn(n * f, v, generator=gen)
        base = torch.randn(n, f, dtype=torch.float64, generator=gen)
        argmax_us = per_call_us(functools.partial(kernels.first_argmax, x), args.calls, args.repeats)
        for k in args.k:
            picks = functools.partial(kernels.beam_picks, x, base, k=k, width=k, frontier=1)
            rows.append({"n": n, "frontier": f, "vocab": v, "k": k,
                         "beam_picks_us": round(per_call_us(picks, args.calls, args.repeats), 1),
                         "first_argmax_us": round(argmax_us, 1)})
    print(json.dumps({"benchmark": "cpu-kernels-picks", "source": source_version(), "cpu": host_cpu(),
                      "python": platform.python_version(), "torch": torch.__version__, "threads": 1,
                      "calls": args.calls, "repeats": args.repeats, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
