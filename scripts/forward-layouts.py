"""What one forward costs by the batch's layout: how many sequences, how many new tokens each, how much context each
(issue 30, docs/benchmarks.md "Twenty-fifth round").

SmartSpec's cost model prices a forward by the batch's context tokens summed, ``alpha * N_ctx`` (and the attention
cells, ``beta * per * N_ctx``). The profiler times probes of at most 8 sequences with equal contexts, so it cannot see
a forward whose cost follows something else, such as the longest sequence's keys: torch's SDPA attends over a padded
``[g, Qmax, Kmax]`` grid. This script times a
pair's target or draft over layouts that share a token count or a context sum and differ in the rest, and sets each
beside the profile's prediction. ``ADASERVE_NATIVE_KERNELS=off`` gives SDPA; the default, where the CPU kernels
build, native/attend.c (``CausalLM.attention_kernels``).

A layout is ``SEQSxTOKENS@CONTEXT``, CONTEXT one number (every sequence the same) or ``LO-HI`` (spread evenly from LO
to HI), e.g. ``32x1@200 32x1@100-300``. Prints JSON: per model and layout, the median and spread of ``--repeats``
timed forwards (after ``--warmup``), N_ctx, and the start-up profile's prediction. ``--fit``: also both cost models
fitted to the layouts' own medians, SmartSpec's (alpha * N_ctx) and with the attention cells (+ beta * N_cells), each
with its errors over the layouts and over the one- and two-token rows of 8 sequences or more (decode-sized batches).

``--probe-contexts 64,256 64,256,1024 64,256,1024x2:64``: the profiler's probes (``probe_split`` chains of 1 .. 256
tokens over at most 8 sequences, or the number after an ``x``) are timed once at every context named (a ``:`` and a
number: that context's probes up to that n only, in the fit; the timings are the same), interleaved as
the profiler times them, and fitted once per list as the profiler fits its own (``summarise_timings``, bent at the
knee); each fit's prediction of every layout, and its mean relative error over all layouts and over the decode-sized
ones, are reported beside the start-up profile's: which probe contexts price the layouts best, paired on one set of
timings (docs/benchmarks.md, "Twenty-seventh round"; ``x`` sequences: "Thirtieth round").

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 python scripts/forward-layouts.py \\
        --layouts 32x1@200 32x1@100-300 32x1@300 32x3@200 32x3@100-300 32x3@300
"""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
import sys
import time
from typing import Any

import torch

from adaserve.bench.engine_only import load_pair, served_config, source_version
from adaserve.cli.arg_types import add_weights_option
from adaserve.engine.cost.budget import KneeConfig
from adaserve.engine.cost.cost_model import CostModel, fit_cost_model
from adaserve.engine.cost.profiler import (
    PROBE_SEQUENCES,
    ProfilerConfig,
    context_label,
    forward_timer,
    measure_interleaved,
    probe_plan,
    size_grid,
    summarise_timings,
)
from adaserve.engine.model.batch import Segment
from adaserve.engine.model.kv_cache import SequenceKV
from adaserve.engine.model.quant import served_attention
from adaserve.engine.model.runner import ModelRunner, chunk_cells
from adaserve.engine.model.tree import TokenTree

LAYOUT = re.compile(r"^(\d+)x(\d+)@(\d+)(?:-(\d+))?$")


def parse_layout(text: str) -> tuple[int, int, list[int]]:
    """``SEQSxTOKENS@CONTEXT`` or ``...@LO-HI`` -> (sequences, new tokens each, each sequence's context)."""
    m = LAYOUT.match(text)
    if m is None:
        raise ValueError(f"layout {text!r}: expected SEQSxTOKENS@CONTEXT or SEQSxTOKENS@LO-HI, e.g. 32x1@100-300")
    n, per, lo = int(m[1]), int(m[2]), int(m[3])
    hi = int(m[4]) if m[4] is not None else lo
    if n < 1 or per < 1 or hi < lo:
        raise ValueError(f"layout {text!r}: at least one sequence and one token each, and LO <= HI")
    contexts = [lo + round((hi - lo) * i / (n - 1)) if n > 1 else lo for i in range(n)]
    return n, per, contexts


def time_layout(runner: ModelRunner, per: int, contexts: list[int], *, repeats: int, warmup: int) -> list[float]:
    """Seconds of ``repeats`` forwards of ``len(contexts)`` sequences with ``per`` new tokens each over those
    cached contexts (the profiler's probe, any layout); the cache is freed after."""
    cache, seqs = runner.cache, [SequenceKV() for _ in contexts]
    try:
        for s, c in zip(seqs, contexts, strict=True):  # the prefix only needs to exist: its values do not matter
            cache.ensure(s, c)
            cache.truncate(s, c)
        segs = [Segment(s, c, TokenTree.chain([1] * per)) for s, c in zip(seqs, contexts, strict=True)]
        out = []
        for i in range(warmup + repeats):
            t0 = time.perf_counter()
            runner.forward(segs, all_logits=[True] * len(segs))
            if i >= warmup:
                out.append(time.perf_counter() - t0)
        return out
    finally:
        for s in seqs:
            cache.release(s)


def fits(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per model, SmartSpec's cost model and the one with the attention cells fitted to the rows' medians: each
    model's coefficients, and its mean relative error over every layout and over the decode-sized ones (8 or more
    sequences of one or two tokens). Pure: the rows ``run`` reports."""
    out: dict[str, Any] = {}
    for name in dict.fromkeys(r["model"] for r in rows):
        mine = [r for r in rows if r["model"] == name]
        # (N_ctx, N_batched, seconds, N_cells): each of a sequence's tokens reads its context and its chunk's keys
        samples = [(r["n_context"], r["tokens"], r["ms"] / 1e3, r["n_cells"]) for r in mine]
        decode = [r["sequences"] >= 8 and r["tokens"] <= 2 * r["sequences"] for r in mine]
        out[name] = {}
        for kind, rows_in in (("smartspec", [x[:3] for x in samples]), ("cells", samples)):
            cost, _ = fit_cost_model(rows_in)
            err = [abs(cost.predict(c, b, k) / y - 1) for c, b, y, k in samples]
            out[name][kind] = {"cost_model": cost.to_dict(), "mean_rel_error": round(statistics.fmean(err), 4),
                               "decode_mean_rel_error": round(statistics.fmean(
                                   [e for e, d in zip(err, decode, strict=True) if d] or [math.nan]), 4)}
    return out


Probe = tuple[int, int, int]  # (cached tokens, most sequences, largest n: 0 for the grid's)
ProbeSet = tuple[Probe, ...]  # one per probe context


def parse_probe_set(text: str) -> ProbeSet:
    """``64,256,1024x2:64`` -> ((64, 8, 0), (256, 8, 0), (1024, 2, 64)): a context's probes over at most 8
    sequences, or the number after ``x`` (``ProbePlan.most``), over the grid of n or up to the number after ``:``."""
    out = set()
    for item in text.split(","):
        c_b, _, top = item.partition(":")
        c, _, b = c_b.partition("x")
        out.add((int(c), int(b) if b else PROBE_SEQUENCES, int(top) if top else 0))
    if len({p[0] for p in out}) != len(out):
        raise ValueError(f"{text}: a context named twice")
    if any(p[2] < 0 for p in out):
        raise ValueError(f"{text}: a largest n below 1")
    return tuple(sorted(out))


def probe_label(s: ProbeSet) -> str:
    """The set as ``parse_probe_set`` reads it (8 sequences and the whole grid left unsaid)."""
    return ",".join(context_label(c, b, top or None) for c, b, top in s)


def probe_fits(runner: ModelRunner, sets: list[ProbeSet], *, repeats: int) -> dict[str, CostModel]:
    """The profiler's probes timed once at every (context, sequences) of ``sets``, fitted once per set, each set's
    contexts on the grid of n or up to their largest (module docstring)."""
    every = sorted({(c, b) for s in sets for c, b, _ in s})  # all of them, on one grid of n (no CPU context added)
    contexts = tuple(sorted({c for c, _ in every}))
    limit = probe_plan(runner, ProfilerConfig(context=contexts[0], fit_contexts=contexts, cpu_contexts=())).limit
    timers = {p: forward_timer(runner, {p[0]: p[1]}) for p in every}
    # measure_interleaved keys its probes by an integer: each (context, sequences) pair's index in ``every``
    timings = measure_interleaved(lambda n, i: timers[every[i]](n, every[i][0]),
                                  [(i, n) for i in range(len(every)) for n in size_grid(limit)],
                                  rounds=repeats, warmup=2, seed=1)
    out = {}
    for s in sets:
        cs = [c for c, _, _ in s]
        table = {c: {n: xs for n, xs in timings[every.index((c, b))].items() if not top or n <= top}
                 for c, b, top in s}
        out[probe_label(s)] = CostModel.from_dict(summarise_timings(
            table, context=256 if 256 in cs else cs[-1], knee=KneeConfig(), most={c: b for c, b, _ in s})["cost_model"])
    return out


def run(model: str, layouts: list[str], *, models: tuple[str, ...], repeats: int, warmup: int,
        probe_sets: list[ProbeSet] | None = None, probe_rounds: int = 5, weights: str = "float") -> dict[str, Any]:
    parsed = [(text, *parse_layout(text)) for text in layouts]
    target, draft, _ = load_pair(model, "cpu", 1024, weights=weights)
    served = served_config(target, draft, model)
    runners = {"target": (target, served.target_cost), "draft": (draft, served.draft_cost)}
    rows = []
    probed: dict[str, dict[str, CostModel]] = {}
    for name in models:
        runner, cost = runners[name]
        if probe_sets:
            probed[name] = probe_fits(runner, probe_sets, repeats=probe_rounds)
        for text, n, per, contexts in parsed:
            xs = time_layout(runner, per, contexts, repeats=repeats, warmup=warmup)
            med = statistics.median(xs)
            # each of a sequence's ``per`` new tokens reads its context and the chunk's keys up to itself
            cells = sum(chunk_cells(per, c) for c in contexts)
            predicted = None if cost is None else round(1e3 * cost.predict(sum(contexts), n * per, cells), 3)
            rows.append({"model": name, "layout": text, "sequences": n, "tokens": n * per, "n_context": sum(contexts),
                         "n_cells": cells,
                         "longest_context": max(contexts), "ms": round(1e3 * med, 3),
                         "spread": round((max(xs) - min(xs)) / med, 3),
                         "predicted_ms": predicted})
            if name in probed:
                rows[-1]["probe_fits_ms"] = {k: round(1e3 * m.predict(sum(contexts), n * per, cells), 3)
                                             for k, m in probed[name].items()}
    out = {"benchmark": "forward-layouts", "source": source_version(), "model": model,
           "attention": {name: served_attention(runners[name][0].model) for name in models},
           "weights": weights, "torch_threads": torch.get_num_threads(), "repeats": repeats, "warmup": warmup,
           "forwards": rows}
    if probed:
        out["probe_fits"] = {name: {k: {"cost_model": m.to_dict(), **errors(
            [r for r in rows if r["model"] == name], lambda r, k=k: r["probe_fits_ms"][k])}
            for k, m in fitted.items()} for name, fitted in probed.items()}
    return out


def errors(rows: list[dict[str, Any]], predicted: Any) -> dict[str, float]:
    """Mean |predicted / measured - 1| over ``rows``, and over the decode-sized ones (8 or more sequences of one or
    two tokens)."""
    err = [abs(predicted(r) / r["ms"] - 1) for r in rows]
    decode = [e for e, r in zip(err, rows, strict=True) if r["sequences"] >= 8 and r["tokens"] <= 2 * r["sequences"]]
    return {"mean_rel_error": round(statistics.fmean(err), 4),
            "decode_mean_rel_error": round(statistics.fmean(decode), 4) if decode else math.nan}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="demo-tiny")
    ap.add_argument("--layouts", nargs="+", required=True, metavar="SEQSxTOKENS@CONTEXT")
    ap.add_argument("--models", nargs="+", choices=("target", "draft"), default=["target", "draft"])
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    add_weights_option(ap)
    ap.add_argument("--fit", action="store_true", help="also fit both cost models to the layouts' medians")
    ap.add_argument("--probe-contexts", nargs="+", default=[], metavar="C1,C2[,..]",
                    help="fit the profiler's probes at each list of contexts (docstring)")
    args = ap.parse_args(argv)
    if min(args.repeats, args.threads) < 1 or args.warmup < 0:
        ap.error("--repeats and --threads must be >= 1, --warmup >= 0")
    try:
        sets = [parse_probe_set(text) for text in args.probe_contexts]
    except ValueError:
        ap.error("--probe-contexts: comma-separated whole numbers, each once, a context's sequences after an x, "
                 "e.g. 64,256 64,256,1024x2")
    if any(len(s) < 2 or min(min(p[:2]) for p in s) < 1 for s in sets):
        ap.error("--probe-contexts: each list needs at least two contexts of at least 1 token and 1 sequence")
    torch.set_num_threads(args.threads)
    try:
        for text in args.layouts:
            parse_layout(text)
        report = run(args.model, args.layouts, models=tuple(args.models), repeats=args.repeats, warmup=args.warmup,
                     probe_sets=sets, weights=args.weights)
        if args.fit:
            report["fits"] = fits(report["forwards"])
    except ValueError as e:  # a bad layout, an unknown model, one without a draft
        print(f"forward-layouts: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
