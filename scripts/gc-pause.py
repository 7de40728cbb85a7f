"""What Python's garbage collector costs a serving process, before and after ``freeze_long_lived`` (issue 30).

A worker loads once and keeps what it loaded; each full collection walks all of it. This script builds what a worker
holds (the worker's modules imported, a model pair loaded, an engine decoding ``--requests`` requests with
speculation: the microbench's ``spec`` mode, one torch thread), then measures twice, first as the process stands and
then after ``loader.freeze_long_lived`` (what the worker calls before it turns ready):

- ``full_collection_ms``: ``gc.collect()`` timed ``--collections`` times (median, min, max): the stall one full
  collection puts into whichever iteration it lands in;
- ``collections``: over ``--iterations`` engine iterations, the automatic collections of each generation that ran
  (``gc.callbacks``), their count per 1,000 iterations and their milliseconds (mean, max).

Prints JSON.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 PYTHONPATH=. python scripts/gc-pause.py \\
        --model demo-tiny --requests 1 --iterations 2000 > out.json
"""

from __future__ import annotations

import argparse
import collections
import gc
import json
import statistics
import time
from typing import Any

import torch

import adaserve.worker.app  # noqa: F401  (what a worker process holds: its web framework's objects too)
from adaserve import allocator
from adaserve.bench.engine_only import host_cpu, load_pair, prompts, source_version
from adaserve.bench.microbench_options import MODES
from adaserve.engine.config import EngineConfig
from adaserve.engine.engine import Engine
from adaserve.engine.loading.loader import freeze_long_lived
from adaserve.engine.request import Phase, Request
from adaserve.engine.speculation.sampling import SamplingParams


class Collections:
    """The automatic collections that run while ``on``: per generation, each one's seconds."""

    def __init__(self) -> None:
        self.seconds: dict[int, list[float]] = collections.defaultdict(list)
        self.on = False
        self._t0 = 0.0
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict[str, Any]) -> None:
        if not self.on:
            return
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self.seconds[int(info["generation"])].append(time.perf_counter() - self._t0)


def full_collections(times: int) -> dict[str, float]:
    spent = []
    for _ in range(times):
        t0 = time.perf_counter()
        gc.collect()
        spent.append((time.perf_counter() - t0) * 1e3)
    return {"median": statistics.median(spent), "min": min(spent), "max": max(spent)}


def fresh_engine(target: Any, draft: Any, ids: list[list[int]], max_tokens: int) -> Engine:
    eng = Engine(target, draft, EngineConfig(policy=MODES["spec"], max_batch=max(64, len(ids))))
    for i, p in enumerate(ids):
        eng.add_request(Request(f"r{i}", p, SamplingParams(max_tokens=max_tokens, ignore_eos=True)))
    while eng.waiting or any(r.phase is not Phase.DECODE for r in eng.running):
        eng.step()
    return eng


def run(eng: Engine, iterations: int, watch: Collections, rebuild: Any) -> tuple[Engine, dict[str, Any]]:
    watch.seconds.clear()
    watch.on = True
    t0 = time.perf_counter()
    for _ in range(iterations):
        if any(r.remaining < 40 for r in eng.running):  # restart before anyone finishes
            for r in list(eng.running):
                eng.abort(r.request_id)
            eng = rebuild()
        eng.step()
    wall = time.perf_counter() - t0
    watch.on = False
    per_gen = {str(g): {"per_1000_iterations": len(s) * 1000 / iterations, "mean_ms": statistics.mean(s) * 1e3,
                        "max_ms": max(s) * 1e3} for g, s in sorted(watch.seconds.items())}
    return eng, {"collections": per_gen, "iteration_ms_mean": wall / iterations * 1e3}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="demo-tiny")
    ap.add_argument("--requests", type=int, default=1)
    ap.add_argument("--iterations", type=int, default=2000)
    ap.add_argument("--collections", type=int, default=5, help="full collections timed before and after the freeze")
    ap.add_argument("--max-tokens", type=int, default=1500)
    args = ap.parse_args()
    if args.requests < 1 or args.iterations < 1 or args.collections < 1:
        ap.error("--requests, --iterations and --collections must be at least 1")
    torch.set_num_threads(1)
    target, draft, tok = load_pair(args.model, "cpu", 512)
    ids = prompts(tok, args.requests, 128)

    def rebuild() -> Engine:
        return fresh_engine(target, draft, ids, args.max_tokens)

    eng = rebuild()
    for _ in range(20):  # the engine's lazy set-up, as the worker's warm-up runs it
        eng.step()
    watch = Collections()
    out: dict[str, Any] = {
        "benchmark": "gc-pause", "source": source_version(), "cpu": host_cpu(), "allocator": allocator.in_use(),
        "model": args.model, "requests": args.requests, "iterations": args.iterations, "threads": 1,
        "policy": "adaserve", "python_gc_thresholds": list(gc.get_threshold()),
    }
    before = {"tracked_objects": len(gc.get_objects()), "full_collection_ms": full_collections(args.collections)}
    eng, ran = run(eng, args.iterations, watch, rebuild)
    out["as_loaded"] = {**before, **ran}
    frozen = freeze_long_lived()
    after = {"frozen_objects": frozen, "tracked_objects": len(gc.get_objects()),
             "full_collection_ms": full_collections(args.collections)}
    eng, ran = run(eng, args.iterations, watch, rebuild)
    out["frozen"] = {**after, **ran}
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
