"""Two checkouts' host time outside the forwards, interleaved in short blocks (issue 30): is a change a few percent
faster or not?

A run of one commit after a run of the other cannot tell a 3% change from a machine whose speed drifts by 10-30%
within the hour (docs/benchmarks.md, "Twenty-third round": four such pairs called six small cuts a tie; this script
found them 3% faster, B lower in 105 of 160 pairs). Here two worker processes, one per checkout, each hold an engine
decoding ``--requests`` requests with speculation (the microbench's ``spec`` mode: the adaserve policy, greedy, one
torch thread, demo-tiny unless ``--model``, float unless ``--weights``), every tree pinned to ``--shape`` (the
policy's own choice is still computed, then dropped: two engines left to choose would draft different mixes of
shapes); ``--mode plain``: plain
decoding instead (the microbench's ``plain`` mode, the incremental policy; no trees). They take turns on one
CPU, ``--block`` iterations at a time: A, B, A, B, ... A block's figure is its milliseconds per iteration outside both
models' forwards (timed by a wrapper of each model's forward; ``--measure forwards``: inside them, for a change to the
forwards; ``iteration``: the whole); the pairs are each A block with the B block after it.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 python scripts/host-time-ab.py BASE_DIR CAND_DIR

BASE_DIR and CAND_DIR are checkouts (``git worktree add --detach DIR COMMIT``; copy demo-tiny's built draft,
``models/demo/draft/model.safetensors``, into each). Each worker is this script run with ``--worker`` and
``PYTHONPATH`` set to its checkout, so it imports that checkout's engine; the helpers it calls
(``bench.engine_only.load_pair`` and ``prompts``, ``bench.microbench_options.MODES``, ``Engine``, ``Request``) are
those of commits since the microbench's options got their own module. The worker is written out here, not shared
with host-time-breakdown.py or put in adaserve.bench: it must run against checkouts older than any helper added since.
Prints JSON: each side's median and mean, the median of the pairs' differences (B - A), how many pairs B was lower,
and a two-sided sign test's p.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import IO, Any


def sign_test_p(lower: int, pairs: int) -> float:
    """Two-sided sign test: the chance of a split at least this uneven if each pair were a coin toss (ties dropped
    by the caller)."""
    if pairs <= 0 or not 0 <= lower <= pairs:
        raise ValueError(f"sign_test_p: need 0 <= lower <= pairs and pairs > 0, got {lower} of {pairs}")
    k = min(lower, pairs - lower)
    tail = sum(math.comb(pairs, i) for i in range(k + 1)) / 2**pairs
    return min(1.0, 2 * tail)


def summarize(a: list[float], b: list[float]) -> dict[str, Any]:
    """Each side's blocks (ms per iteration), paired in order: A's block i with B's block i."""
    diffs = [y - x for x, y in zip(a, b, strict=True)]
    untied = [d for d in diffs if d != 0]
    lower = sum(d < 0 for d in untied)
    return {
        "pairs": len(diffs),
        "a_median_ms": statistics.median(a), "b_median_ms": statistics.median(b),
        "a_mean_ms": statistics.mean(a), "b_mean_ms": statistics.mean(b),
        "diff_median_ms": statistics.median(diffs),
        "diff_median_share": statistics.median(diffs) / statistics.median(a),
        "b_lower_pairs": lower,
        "sign_test_p": sign_test_p(lower, len(untied)) if untied else 1.0,
    }


# ---- a worker: one checkout's engine, a block of iterations on each "go" ----------------------------------------
def worker(args: argparse.Namespace) -> None:
    import torch

    from adaserve.bench.engine_only import load_pair, prompts
    from adaserve.bench.microbench_options import MODES
    from adaserve.engine.config import EngineConfig
    from adaserve.engine.engine import Engine
    from adaserve.engine.model.quant import served_weights
    from adaserve.engine.request import Phase, Request
    from adaserve.engine.speculation.policies import TreeShape
    from adaserve.engine.speculation.sampling import SamplingParams

    os.sched_setaffinity(0, {args.cpu})
    torch.set_num_threads(1)
    depth, width = args.shape
    # served weights only when asked: a checkout from before load_pair took them still runs the float default
    target, draft, tok = (load_pair(args.model, "cpu", 512) if args.weights == "float"
                          else load_pair(args.model, "cpu", 512, weights=args.weights))
    inside = [0.0]

    def timed(forward: Any) -> Any:
        """``forward`` timed into ``inside``: the forwards' time, left out of every block's figure. A wrapper the
        module calls as its ``forward``, not hooks: with hooks ``nn.Module`` takes a slower call path, most of
        whose work would land outside the span (engine_only.ForwardClock)."""

        def call(*a: Any, **k: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return forward(*a, **k)
            finally:
                inside[0] += time.perf_counter() - t0

        return call

    for model in (target.model, draft.model):
        model.forward = timed(model.forward)
    ids = prompts(tok, args.requests, 128)

    def fresh() -> Any:
        eng = Engine(target, draft, EngineConfig(policy=MODES[args.mode], max_batch=max(64, args.requests)))
        if args.mode == "spec":
            policy, shape = eng.policy, TreeShape(depth, width)
            chosen = type(policy).tree_shape.__get__(policy)

            def pinned(view: Any) -> Any:
                chosen(view)  # its cost is paid, its choice dropped
                return shape

            object.__setattr__(policy, "tree_shape", pinned)  # policies are frozen dataclasses
        for i, p in enumerate(ids):
            eng.add_request(Request(f"r{i}", p, SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)))
        while eng.waiting or any(r.phase is not Phase.DECODE for r in eng.running):
            eng.step()
        for _ in range(5):
            eng.step()
        return eng

    eng = fresh()
    print(json.dumps({"ready": True, "policy": eng.policy.name, "served": served_weights(target.model)}), flush=True)
    for line in sys.stdin:
        if line.strip() != "go":
            break
        total = 0.0
        for _ in range(args.block):
            if eng.running[0].target_kv.length > args.max_tokens - 40:  # restart, untimed, before anyone finishes
                for r in list(eng.running):
                    eng.abort(r.request_id)
                eng = fresh()
            before, t0 = inside[0], time.perf_counter()
            eng.step()
            spent, forwards = time.perf_counter() - t0, inside[0] - before
            total += {"host": spent - forwards, "forwards": forwards, "iteration": spent}[args.measure]
        print(json.dumps({"ms": total / args.block * 1e3}), flush=True)


# ---- the driver ------------------------------------------------------------------------------------------------
def source(checkout: Path) -> str:
    """The checkout's commit, ``+dirty`` when its tracked files differ from it ("unknown" outside git)."""
    try:
        rev = subprocess.run(["git", "-C", str(checkout), "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, timeout=30, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(checkout), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=30, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return rev + ("+dirty" if dirty else "")


def _read(stream: IO[str], who: str) -> dict[str, Any]:
    line = stream.readline()
    if not line:
        raise SystemExit(f"host-time-ab: the {who} worker stopped (its error is above)")
    return json.loads(line)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("base", nargs="?", type=Path, help="checkout A")
    ap.add_argument("cand", nargs="?", type=Path, help="checkout B")
    ap.add_argument("--blocks", type=int, default=160, help="blocks per side (default 160)")
    ap.add_argument("--block", type=int, default=25, help="iterations per block (default 25)")
    ap.add_argument("--requests", type=int, default=1)
    ap.add_argument("--shape", type=lambda s: tuple(int(x) for x in s.split(",")), default=(4, 2),
                    help="D,W: every tree's depth and width (default 4,2)")
    ap.add_argument("--mode", choices=("spec", "plain"), default="spec",
                    help="the microbench's mode: spec (trees pinned to --shape) or plain (no trees; --shape unused)")
    ap.add_argument("--model", default="demo-tiny")
    ap.add_argument("--weights", choices=("float", "int8", "int4", "auto"), default="float",
                    help="the pair's linear layers as the microbench's --weights serves them (default float)")
    ap.add_argument("--max-tokens", type=int, default=1800)
    ap.add_argument("--cpu", type=int, default=None, help="the CPU both workers run on (default: the first allowed)")
    ap.add_argument("--measure", choices=("host", "forwards", "iteration"), default="host",
                    help="each block's figure: ms per iteration outside both models' forwards (default), inside them, "
                         "or the whole iteration")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if len(args.shape) != 2 or min(args.shape) < 1:
        ap.error("--shape: two integers >= 1, D,W")
    if args.worker:
        worker(args)
        return
    if args.base is None or args.cand is None:
        ap.error("give two checkouts: BASE_DIR CAND_DIR")
    for d in (args.base, args.cand):
        if not (d / "adaserve" / "__init__.py").is_file():
            ap.error(f"{d}: not a checkout of adaserve (no adaserve/__init__.py)")
    if args.blocks < 1 or args.block < 1:
        ap.error("--blocks and --block must be >= 1")
    cpu = args.cpu if args.cpu is not None else min(os.sched_getaffinity(0))
    passed = [f"--block={args.block}", f"--requests={args.requests}", f"--shape={args.shape[0]},{args.shape[1]}",
              f"--model={args.model}", f"--max-tokens={args.max_tokens}", f"--measure={args.measure}",
              f"--mode={args.mode}", f"--weights={args.weights}"]
    procs = []
    for d in (args.base, args.cand):
        env = {**os.environ, "PYTHONPATH": str(d.resolve())}
        procs.append(subprocess.Popen([sys.executable, __file__, "--worker", f"--cpu={cpu}", *passed], cwd=d, env=env,
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True))
    try:
        policies, served = [], []
        for p, who in zip(procs, ("base", "candidate"), strict=True):
            assert p.stdout is not None
            ready = _read(p.stdout, who)  # loaded and warmed up
            policies.append(ready.get("policy"))
            served.append(ready.get("served"))
        blocks: list[list[float]] = [[], []]
        for b in range(args.blocks):
            for side, (p, who) in enumerate(zip(procs, ("base", "candidate"), strict=True)):
                assert p.stdin is not None and p.stdout is not None
                p.stdin.write("go\n")
                p.stdin.flush()
                blocks[side].append(_read(p.stdout, who)["ms"])
            print(f"\r[{b + 1}/{args.blocks}] blocks", end="", file=sys.stderr, flush=True)
        print(file=sys.stderr)
    finally:
        for p in procs:
            if p.stdin is not None:
                p.stdin.close()
            p.wait(timeout=60)
    report = {"benchmark": "host-time-ab", "base": str(args.base), "base_source": source(args.base),
              "candidate": str(args.cand), "candidate_source": source(args.cand), "cpu": cpu,
              "model": args.model, "weights": args.weights, "requests": args.requests, "mode": args.mode,
              "policies": policies, "served_weights": served,
              "shape": f"{args.shape[0]},{args.shape[1]}" if args.mode == "spec" else None,
              "measure": args.measure,
              "block": args.block, **summarize(*blocks), "a_blocks_ms": blocks[0], "b_blocks_ms": blocks[1]}
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
