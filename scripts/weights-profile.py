"""Where a lone request's decode step spends its CPU time, per op, with float32, int8 and int4 weights (issue 35).

    PYTHONPATH=. python scripts/weights-profile.py --weights int4,int8,float --threads 1,2 --policy incremental

For each weights option and thread count: the default pair built as ``scripts/weights-bench.py`` builds it,
one lone request decoded for ``--warm`` tokens, then ``--tokens`` more under ``torch.profiler``; prints, per
cell, the wall time per decode step, the profiler's top ops by self CPU time per step, and the share of
the step spent in the target's forward, the LM head and the draft. JSON on stdout.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from adaserve.engine.build import build_engine
from adaserve.engine.loading.catalog import DEFAULT_MODEL, resolve
from adaserve.engine.loading.chat import instruction_ids
from adaserve.engine.request import Request
from adaserve.engine.speculation.sampling import SamplingParams

PROMPT = "Write a Python function that reverses a linked list."


def labelled(module: torch.nn.Module, label: str) -> None:
    """Wrap ``module.forward`` in a profiler range named ``label``."""
    inner = module.forward

    def forward(*args: Any, **kwargs: Any) -> Any:
        with record_function(label):
            return inner(*args, **kwargs)

    module.forward = forward  # type: ignore[method-assign]


def cell(eng: Any, prompt: list[int], warm: int, tokens: int, top: int) -> dict[str, Any]:
    req = Request("p", prompt, SamplingParams(max_tokens=warm + tokens + 1, ignore_eos=True))
    eng.add_request(req)
    while len(req.output_ids) < warm:
        eng.step()
    n0, t0 = len(req.output_ids), time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        while len(req.output_ids) < n0 + tokens:
            with record_function("step"):
                eng.step()
    wall = time.perf_counter() - t0
    produced = len(req.output_ids) - n0
    while eng.has_work:
        eng.step()
    ev = prof.key_averages()
    total = {e.key: e.cpu_time_total for e in ev}  # microseconds, inclusive
    ops = sorted(
        (e for e in ev if not e.key.startswith(("step", "target", "draft", "lm_head"))),
        key=lambda e: -e.self_cpu_time_total,
    )
    per_tok = 1e-3 / produced  # microseconds in total -> milliseconds per token
    return {
        "tokens": produced,
        "wall_ms_per_token": round(1e3 * wall / produced, 2),
        "inclusive_ms_per_token": {
            k: round(total.get(k, 0) * per_tok, 2)
            for k in ("step", "target", "target.lm_head", "draft", "draft.lm_head")
        },
        "ops_self_ms_per_token": [
            [e.key, round(e.self_cpu_time_total * per_tok, 3), e.count // produced] for e in ops[:top]
        ],
        "ops_per_token": sum(e.count for e in ev if not e.key.startswith(("step", "target", "draft"))) // produced,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--weights", default="int4,int8,float")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--policy", default="incremental")
    ap.add_argument("--warm", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--top", type=int, default=14)
    args = ap.parse_args()
    out = []
    for weights in args.weights.split(","):
        pair = resolve(DEFAULT_MODEL, progress=False, weights=weights)
        built = build_engine(
            target=pair.target,
            draft=pair.draft,
            policy=args.policy,
            budget=32,
            weights=weights,
            progress=False,
            profile=False,
        )
        eng = built.engine
        labelled(eng.target.model, "target")
        labelled(eng.target.model.lm_head, "target.lm_head")
        for d in getattr(eng, "drafts", []) or []:
            labelled(d.model, "draft")
            labelled(d.model.lm_head, "draft.lm_head")
        prompt = instruction_ids(built.tokenizer, PROMPT)
        for threads in (int(t) for t in args.threads.split(",")):
            torch.set_num_threads(threads)
            res = {
                "weights": weights,
                "policy": args.policy,
                "threads": threads,
                **cell(eng, prompt, args.warm, args.tokens, args.top),
            }
            print(json.dumps(res), file=sys.stderr, flush=True)
            out.append(res)
    print(json.dumps({"model": DEFAULT_MODEL, "torch": torch.__version__, "cells": out}, indent=1))


if __name__ == "__main__":
    main()
