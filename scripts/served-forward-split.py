"""Where the served policy's price of an iteration misses, model by model (issue 30, docs/benchmarks.md "Twenty-fourth
round").

An engine as ``build_engine`` serves it (``engine_only.served_config``: the start-up profile's budget, cost models and
tree bounds) decodes ``--requests`` requests, greedy, ``ignore_eos``, one torch thread unless ``--threads``. After
``--warmup`` iterations it times ``--steps`` more, each model's forwards by hooks (``engine_only.ForwardClock``), and
sets them beside what the engine's online cost models predict for the tokens those forwards really fed:

    target   T_target(N_ctx, verified tokens)
    draft    T_draft(N_ctx, P) + (d - 1) T_draft(N_ctx, n w)     P: the catch-up, every token the draft had not seen

(a plain streak's probe, "DxW probe", over the one request that drafts), so a miss here is the cost model's, not
the shape rule's steady-state assumption (``adaserve.engine.speculation.adaptive.draft_seconds``); beside it the
draft's price before the catch-up was priced, every forward a level: d T_draft(N_ctx, n w).
Prints JSON: per shape chosen ("DxW" or "plain"), the iterations and the median measured and predicted ms of each
model; each model's online cost model at the end (its source, the correction on the profile, its coefficients);
and the draft's largest recorded forwards (context, new tokens, ms).

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 python scripts/served-forward-split.py --requests 32
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict
from dataclasses import asdict, replace
from typing import Any

import torch

from adaserve.bench.engine_only import ForwardClock, load_pair, prompts, served_config, source_version
from adaserve.bench.microbench_options import MODES
from adaserve.engine.engine import Engine
from adaserve.engine.request import Phase, Request
from adaserve.engine.speculation.policies import TreeShape
from adaserve.engine.speculation.sampling import SamplingParams


def run(model: str, requests: int, steps: int, warmup: int, host_cost: bool) -> dict[str, Any]:
    target, draft, tok = load_pair(model, "cpu", 512)
    cfg = replace(served_config(target, draft, model), policy=MODES["spec"], max_batch=max(64, requests),
                  host_cost=host_cost)
    eng = Engine(target, draft, cfg)
    longest = (warmup + steps + 2) * (cfg.adaptive.d_max + 1)  # no request ends while timed (engine_only's rule)
    for i, ids in enumerate(prompts(tok, requests, 128)):
        eng.add_request(Request(f"r{i}", ids, SamplingParams(max_tokens=longest, ignore_eos=True)))
    while eng.waiting or any(r.phase is not Phase.DECODE for r in eng.running):
        eng.step()
    for _ in range(warmup):
        eng.step()
    chosen: list[TreeShape | None] = [None]
    policy_shape = type(eng.policy).tree_shape.__get__(eng.policy)

    def recorded(view: Any) -> TreeShape | None:
        chosen[0] = policy_shape(view)
        return chosen[0]

    object.__setattr__(eng.policy, "tree_shape", recorded)  # the policy's own choice, kept to read its probe flag
    clocks = ForwardClock(target.model), ForwardClock(draft.model)
    rows: dict[str, list[tuple[float, float, float, float, float]]] = defaultdict(list)
    try:
        for _ in range(steps):
            decoding = list(eng.running)
            ctx = sum(r.target_kv.length for r in decoding)
            t0, d0 = clocks[0].seconds, clocks[1].seconds
            eng.step()
            m, shape_of = eng.history[-1], chosen[0]
            shape = f"{m.depth}x{m.width}" if m.depth else "plain"
            draft_pred = as_levels = 0.0
            if m.depth:
                drafting = decoding
                if shape_of is not None and shape_of.probe and len(decoding) > 1:  # one request drafts (Engine's)
                    drafting = [min(decoding, key=lambda r: r.draft_pending)]
                    shape += " probe"
                n, d_ctx = len(drafting), sum(r.target_kv.length for r in drafting)
                price = eng.draft_time.for_batch(n)  # each request's context read by its share (the engine's price)
                level = price(d_ctx, n * m.width)
                catch_up = sum(r.draft_pending for r in drafting)
                draft_pred = price(d_ctx, catch_up) + (m.depth - 1) * level
                as_levels = m.depth * level  # the price before the catch-up was priced: every forward a level
            verify_pred = eng.target_time.for_batch(len(decoding))(ctx, m.tokens_verified)
            rows[shape].append((clocks[0].seconds - t0, verify_pred, clocks[1].seconds - d0, draft_pred, as_levels))
    finally:
        for c in clocks:
            c.remove()

    def ms(xs: list[float]) -> float:
        return round(1e3 * statistics.median(xs), 3)

    def online(cm: Any) -> dict[str, Any]:
        return {"source": cm.source, "correction": cm.correction, "model": asdict(cm.model)}

    biggest = sorted(eng.draft_time.samples, key=lambda s: -s[2])[:5]
    for r in list(eng.running):
        eng.abort(r.request_id)
    return {"benchmark": "served-forward-split", "source": source_version(), "model": model, "requests": requests,
            "steps": steps, "warmup": warmup, "host_cost": host_cost, "budget": cfg.budget,
            "d_max": cfg.adaptive.d_max, "w_max": cfg.adaptive.w_max, "torch_threads": torch.get_num_threads(),
            "shapes": {s: {"iterations": len(rs), "target_ms": ms([r[0] for r in rs]),
                           "target_predicted_ms": ms([r[1] for r in rs]), "draft_ms": ms([r[2] for r in rs]),
                           "draft_predicted_ms": ms([r[3] for r in rs]),
                           "draft_priced_as_levels_ms": ms([r[4] for r in rs])} for s, rs in sorted(rows.items())},
            "target_cost_model": online(eng.target_time), "draft_cost_model": online(eng.draft_time),
            "draft_largest_forwards": [{"context": c, "new": b, "cells": k, "ms": round(1e3 * y, 3)}
                                       for c, b, y, k in biggest]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="demo-tiny")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--warmup", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--host-cost", action="store_true", help="the shape rules price the engine's host time too")
    args = ap.parse_args(argv)
    if min(args.requests, args.steps, args.threads) < 1 or args.warmup < 0:
        ap.error("--requests, --steps and --threads must be >= 1, --warmup >= 0")
    torch.set_num_threads(args.threads)
    try:
        report = run(args.model, args.requests, args.steps, args.warmup, args.host_cost)
    except ValueError as e:  # an unknown model, one without a draft
        print(f"served-forward-split: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
