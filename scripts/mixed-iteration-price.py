"""How well an iteration that carries prompt chunks beside decoding requests is priced (issue 30, docs/benchmarks.md
"Twenty-seventh round"): three ways of pricing the same forwards, from the same profile probes, in one run.

1. The target's start-up probes are timed once (the profiler's grid, ``probe_grid``: ``probe_split`` chains over 64,
   256 and 1,024 cached tokens, the last over fewer sequences where the cache holds fewer: ``probe_plan``; interleaved
   rounds) and fitted three ways, each bent at the profile's knee:

       smartspec     alpha * N_ctx + gamma * N_batched + delta
       cached-cells  + beta * N_cells, N_cells = sum new x cached (e5c6892's cells: a probe's n * c)
       chunk-cells   + beta * N_cells, N_cells = sum runner.chunk_cells(new, cached) (this commit's, the profiler's own)

2. An engine with that pair decodes plainly (policy ``incremental``) for ``--decoding`` requests of 128-token prompts
   while a prompt of ``--prompt-tokens`` tokens arrives every ``--every`` iterations and is prefilled in chunks of
   ``--chunk`` tokens ("fixed" rule) beside them. Each target forward is recorded: the decoding requests' context and
   tokens, each prompt chunk's tokens and cached tokens, its wall time.

3. Each forward is priced as each commit's engine would price it:

       smartspec     smartspec(ctx_dec, N)                                  (before the cells)
       spread        cached-cells(ctx_dec, N, ctx_dec * N / n)               (e5c6892: the chunk's tokens spread over
                                                                              the n decoding requests' context)
       own-keys      chunk-cells(ctx_dec + ctx_chunks, N, even_cells(ctx_dec, N - P, n) + sum chunk_cells(p, c))
                                                                             (this commit: timing.PromptLoad)

   N the forward's tokens, P its prompt tokens. Prints JSON: the three fits, and per pricing and kind of iteration
   ("mixed": with a chunk; "decode": without) the median of predicted / measured and the mean and 90th percentile of
   |predicted / measured - 1|. Paired: every pricing sees the same probes and the same forwards.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 python scripts/mixed-iteration-price.py
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch

from adaserve.bench.engine_only import load_pair, prompts, served_config, source_version
from adaserve.engine.cost.budget import choose_budget
from adaserve.engine.cost.cost_model import CostModel, even_cells, fit_cost_model
from adaserve.engine.cost.profiler import (
    ProfilerConfig,
    _roofline,
    forward_timer,
    measure_interleaved,
    probe_grid,
    probe_plan,
    probe_split,
)
from adaserve.engine.engine import Engine
from adaserve.engine.model.runner import ModelRunner, chunk_cells
from adaserve.engine.request import Phase, Request
from adaserve.engine.speculation.sampling import SamplingParams

Forward = tuple[int, int, int, list[tuple[int, int]], float]  # ctx_dec, n_decode, n_new, chunks (new, cached), s
# a probe's attention cells from its chains (``probe_split``: new tokens per sequence) over c cached tokens each
CELLS: dict[str, Callable[[list[int], int], int] | None] = {
    "smartspec": None, "cached-cells": lambda split, c: sum(split) * c,
    "chunk-cells": lambda split, c: sum(chunk_cells(k, c) for k in split)}


def fits(runner: ModelRunner, cfg: ProfilerConfig) -> dict[str, CostModel]:
    """The probes timed once, fitted with each definition of the cells (module docstring)."""
    plan = probe_plan(runner, cfg)
    timings = measure_interleaved(forward_timer(runner, plan.most), probe_grid(runner, cfg), rounds=cfg.repeats,
                                  warmup=cfg.warmup, seed=1)
    knee = choose_budget(_roofline(timings[cfg.context]), cfg.knee)
    out = {}
    for name, cells in CELLS.items():
        samples = [(len(split) * c, p.n_tokens, p.latency_s) if cells is None
                   else (len(split) * c, p.n_tokens, p.latency_s, cells(split, c))
                   for c in sorted(timings) for p in _roofline(timings[c])
                   for split in [probe_split(p.n_tokens, plan.most[c])]]
        out[name] = fit_cost_model(samples, knee=knee)[0]
    return out


def prices(models: dict[str, CostModel], f: Forward) -> dict[str, float]:
    """One forward priced the three ways (module docstring)."""
    ctx, n, total, chunks, _ = f
    p = sum(k for k, _ in chunks)
    return {"smartspec": models["smartspec"].predict(ctx, total),
            "spread": models["cached-cells"].predict(ctx, total, ctx * total / n),
            "own-keys": models["chunk-cells"].predict(
                ctx + sum(c for _, c in chunks), total,
                even_cells(ctx, total - p, n) + sum(chunk_cells(k, c) for k, c in chunks))}


def summary(pairs: list[tuple[float, float]]) -> dict[str, Any]:
    """(predicted s, measured s) pairs -> the figures the docstring names."""
    if not pairs:
        return {"iterations": 0}
    ratios = [p / y for p, y in pairs]
    errors = sorted(abs(r - 1) for r in ratios)
    return {"iterations": len(pairs), "median_ratio": round(statistics.median(ratios), 4),
            "mean_abs_error": round(statistics.fmean(errors), 4),
            "p90_abs_error": round(errors[min(len(errors) - 1, int(0.9 * len(errors)))], 4)}


def record(eng: Engine, *, pool: list[int], prompt_tokens: int, every: int, iterations: int) -> list[Forward]:
    """The workload of the module docstring's step 2; each iteration's target forward with a decoding request in it."""
    cut: list[list[tuple[int, int]]] = []  # each step's prompt chunks, as _prefill_segments cut them
    cut_segments = eng._prefill_segments

    def segments(m: Any) -> Any:
        out = cut_segments(m)
        cut.append([(seg.tree.size, seg.prefix_len) for _, seg in out])
        return out

    eng._prefill_segments = segments  # type: ignore[method-assign]
    walls: list[float] = []
    eng.target.forward_listeners.append(lambda rec: walls.append(rec.wall_s))
    out: list[Forward] = []
    for it in range(iterations):
        if it % every == 0:
            at = (it // every * 997) % (len(pool) - prompt_tokens + 1)
            eng.add_request(Request(f"p{it}", pool[at : at + prompt_tokens],
                                    SamplingParams(max_tokens=2, ignore_eos=True)))
        ctx = sum(r.target_kv.length for r in eng.running if r.phase is Phase.DECODE)
        n_walls = len(walls)
        eng.step()
        m = eng.history[-1]
        if len(walls) == n_walls + 1 and m.n_decode:
            out.append((ctx, m.n_decode, m.tokens_verified + m.prefill_tokens, cut[-1], walls[-1]))
    return out


def run(model: str, *, decoding: int, prompt_tokens: int, every: int, chunk: int, iterations: int,
        warmup: int, probes: ProfilerConfig | None = None) -> dict[str, Any]:
    """``probes``: how the probes are timed (the profiler's own settings by default; a test times fewer)."""
    target, draft, tok = load_pair(model, "cpu", 1024)
    models = fits(target, probes or ProfilerConfig())
    cfg = replace(served_config(target, draft, model), policy="incremental", prefill_chunk=chunk,
                  prefill_rule="fixed", max_batch=max(64, decoding + 8))
    eng = Engine(target, None, cfg)
    # long prompts: the pool's prompts one after another (a forward's time does not depend on the token values)
    pool = list(itertools.chain.from_iterable(prompts(tok, 64, 4096)))
    if len(pool) < prompt_tokens:
        raise SystemExit(f"--prompt-tokens {prompt_tokens}: the prompt pool holds {len(pool)} tokens")
    for i, ids in enumerate(prompts(tok, decoding, 128)):
        eng.add_request(Request(f"d{i}", ids, SamplingParams(max_tokens=warmup + iterations + 8, ignore_eos=True)))
    while eng.waiting or any(r.phase is not Phase.DECODE for r in eng.running):
        eng.step()
    for _ in range(warmup):
        eng.step()
    forwards = record(eng, pool=pool, prompt_tokens=prompt_tokens, every=every, iterations=iterations)
    table: dict[str, dict[str, list[tuple[float, float]]]] = {}
    for f in forwards:
        kind = "mixed" if f[3] else "decode"
        for name, p in prices(models, f).items():
            table.setdefault(name, {"mixed": [], "decode": []})[kind].append((p, f[4]))
    mixed, decode = [f for f in forwards if f[3]], [f for f in forwards if not f[3]]
    return {"benchmark": "mixed-iteration-price", "source": source_version(), "model": model,
            "torch_threads": torch.get_num_threads(), "decoding": decoding, "prompt_tokens": prompt_tokens,
            "every": every, "chunk": chunk, "iterations": iterations, "warmup": warmup,
            "fits": {name: m.to_dict() for name, m in models.items()},
            "pricings": {name: {kind: summary(v) for kind, v in kinds.items()} for name, kinds in table.items()},
            "median_measured_ms": {kind: round(1e3 * statistics.median(f[4] for f in fs), 3) if fs else None
                                   for kind, fs in (("mixed", mixed), ("decode", decode))},
            "mean_chunk_tokens": round(statistics.fmean(sum(k for k, _ in f[3]) for f in mixed), 1) if mixed else None}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="demo-tiny")
    ap.add_argument("--decoding", type=int, default=8, help="requests decoding throughout")
    ap.add_argument("--prompt-tokens", type=int, default=768, help="each arriving prompt's length")
    ap.add_argument("--every", type=int, default=6, help="iterations between arriving prompts")
    ap.add_argument("--chunk", type=int, default=256, help="prompt tokens an iteration carries (fixed rule)")
    ap.add_argument("--iterations", type=int, default=240)
    ap.add_argument("--warmup", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    for name in ("decoding", "prompt_tokens", "every", "chunk", "iterations", "threads"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.warmup < 0:
        ap.error("--warmup must be at least 0")
    torch.set_num_threads(args.threads)
    out = run(args.model, decoding=args.decoding, prompt_tokens=args.prompt_tokens, every=args.every,
              chunk=args.chunk, iterations=args.iterations, warmup=args.warmup)
    json.dump(out, sys.stdout, indent=2)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
