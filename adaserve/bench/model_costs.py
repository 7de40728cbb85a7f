"""What one forward of the target and of the draft costs, per dtype, measured side by side.

    python -m adaserve.bench.model_costs --json docs/results/model-costs-cpu.json

For each dtype (float32, bfloat16) the pair is loaded once; then ``--rounds`` rounds each time every
(dtype, model, n) forward once, interleaved, so a busy spell of a shared machine hits all of them alike.
A forward carries n new tokens over prefixes of ``--context`` cached tokens (the profiler's probe shape).
Reported per (dtype, model, n): median and quartiles over rounds; per dtype: the target:draft latency
ratio at n = 1 (what one draft step costs against one target step), and bfloat16 / float32 per model.
``--check-greedy`` adds, per dtype and policy, whether the engine's greedy output equals transformers'
greedy ``generate`` in that dtype on six chat prompts (does the dtype keep "identical to the target" true?).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from adaserve.engine.build import build_engine
from adaserve.engine.cost.profiler import time_forward
from adaserve.engine.loading.catalog import DEFAULT_MODEL, resolve

DTYPES = ("float32", "bfloat16")


def quartiles(xs: list[float]) -> dict[str, float]:
    q = statistics.quantiles(xs, n=4) if len(xs) > 1 else [xs[0]] * 3
    return {"median_ms": 1e3 * statistics.median(xs), "p25_ms": 1e3 * q[0], "p75_ms": 1e3 * q[2]}


def measure(model: str, *, dtypes: tuple[str, ...], grid: tuple[int, ...], context: int,
            rounds: int) -> dict[str, Any]:
    pair = resolve(model)
    runners = {}
    for dt in dtypes:
        eng = build_engine(target=pair.target, draft=pair.draft, policy="chain:1", budget=64, dtype=dt,
                           profile=False, progress=False).engine
        runners[dt] = {"target": eng.target, "draft": eng.draft}
    samples: dict[tuple[str, str, int], list[float]] = {}
    probes = [(dt, m, n) for dt in dtypes for m in ("target", "draft") for n in grid]
    for dt, m, n in probes:  # warm-up: first calls allocate and pick kernels
        time_forward(runners[dt][m], n_tokens=n, context=context, repeats=1, warmup=1)
    for _ in tqdm(range(rounds), desc="rounds", unit="round"):
        for dt, m, n in probes:
            t = time_forward(runners[dt][m], n_tokens=n, context=context, repeats=1, warmup=0)
            samples.setdefault((dt, m, n), []).append(t)
    table = [{"dtype": dt, "model": m, "n_tokens": n, **quartiles(samples[(dt, m, n)])} for dt, m, n in probes]
    # ratios per round, then the median: a slow spell moves numerator and denominator together
    ratios = {}
    for dt in dtypes:
        per_round = [a / b for a, b in zip(samples[(dt, "target", 1)], samples[(dt, "draft", 1)], strict=True)]
        ratios[f"target_over_draft_n1_{dt}"] = statistics.median(per_round)
    if "float32" in dtypes and "bfloat16" in dtypes:
        for m in ("target", "draft"):
            for n in grid:
                per_round = [a / b for a, b in zip(samples[("bfloat16", m, n)], samples[("float32", m, n)],
                                                   strict=True)]
                ratios[f"bf16_over_fp32_{m}_n{n}"] = statistics.median(per_round)
    return {"config": {"model": model, "target": str(pair.target.name), "draft": str(pair.draft.name if pair.draft
                                                                                     else None),
                       "dtypes": list(dtypes), "grid": list(grid), "context": context, "rounds": rounds,
                       "threads": torch.get_num_threads(), "torch": torch.__version__,
                       "cpu": platform.processor() or platform.machine(), "device": "cpu"},
            "table": table, "ratios": ratios}


GREEDY_PROMPTS = ("What is the capital of France?", "Write a Python function that reverses a list.",
                  "Explain what a database index is.", "Name three primary colors.", "How do vaccines work?",
                  "def fibonacci(n):")


def greedy_agreement(model: str, *, dtypes: tuple[str, ...], policies: tuple[str, ...],
                     new_tokens: int) -> dict[str, Any]:
    """Per dtype and policy: does the engine's greedy output equal transformers' greedy ``generate`` in the
    same dtype, prompt by prompt? (The six prompts run as one batch through the engine.)"""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from adaserve.engine.loading.chat import instruction_ids
    from adaserve.engine.request import Request
    from adaserve.engine.speculation.sampling import SamplingParams

    pair = resolve(model, progress=False)
    tok = AutoTokenizer.from_pretrained(str(pair.target))
    ids = [instruction_ids(tok, p) for p in GREEDY_PROMPTS]
    out: dict[str, Any] = {"prompts": list(GREEDY_PROMPTS), "new_tokens": new_tokens}
    for dt in dtypes:
        hf = AutoModelForCausalLM.from_pretrained(str(pair.target), dtype=getattr(torch, dt)).eval()
        eos = hf.generation_config.eos_token_id
        refs = [hf.generate(torch.tensor([i]), max_new_tokens=new_tokens, do_sample=False,
                            pad_token_id=eos)[0, len(i):].tolist() for i in ids]
        for pol in policies:
            eng = build_engine(target=pair.target, draft=pair.draft, policy=pol, budget=64, dtype=dt,
                               profile=False, progress=False).engine
            reqs = [Request(f"r{k}", i, SamplingParams(max_tokens=new_tokens)) for k, i in enumerate(ids)]
            eng.run([(0.0, r) for r in reqs])
            out[f"{dt}/{pol}"] = [r.output_ids == ref[: len(r.output_ids)] for r, ref in zip(reqs, refs, strict=True)]
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--grid", default="1,4,16,64", help="tokens per forward, comma-separated")
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--check-greedy", action="store_true",
                   help="also compare greedy outputs with transformers' in each dtype (incremental, adaserve, chain:4)")
    p.add_argument("--json", type=Path)
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    out = measure(a.model, dtypes=DTYPES, grid=tuple(int(x) for x in a.grid.split(",")), context=a.context,
                  rounds=a.rounds)
    if a.check_greedy:
        out["greedy_equals_transformers"] = greedy_agreement(
            a.model, dtypes=DTYPES, policies=("incremental", "adaserve", "chain:4"), new_tokens=48)
    text = json.dumps(out, indent=2)
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(text + "\n")
    print(text, file=sys.stdout)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
