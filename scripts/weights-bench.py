"""Lone-request TPOT and 8-concurrent throughput of the default pair with float32, int8 and int4 weights,
with (adaserve) and without (incremental) speculation, on this machine's CPU; prints JSON (issue 35).

    PYTHONPATH=. python scripts/weights-bench.py --threads 1,2 --tokens 64 > docs/results/weights-cpu.json

Each cell builds the engine with ``build_engine`` (a fixed budget: no profiling), decodes one warm-up
request, then times ``--tokens`` greedy tokens of one request (TPOT: decode wall time / tokens after the
first) and of ``--concurrency`` requests at once (throughput: tokens / wall time). ``float`` is the
dequantized GGUF in float32; ``int8`` the GGUF converted with --weights int8 (Q4_1 re-quantized per row);
``int4`` with --weights int4 (the file's Q4_1 blocks as they are, the same layers as --weights auto). The
draft (float32 on disk) is quantized at load to the same kind. Resident memory: the max RSS after loading each cell's
models is reported too (ru_maxrss only grows, so cells run float last).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import sys
import time
from typing import Any

import torch

from adaserve.engine.build import build_engine
from adaserve.engine.loading.catalog import DEFAULT_MODEL, resolve
from adaserve.engine.loading.chat import instruction_ids
from adaserve.engine.model.quant import served_weights, weight_bytes
from adaserve.engine.request import Request
from adaserve.engine.speculation.sampling import SamplingParams

WEIGHTS = {"int4": "int4", "int8": "int8", "float": "float"}  # label -> --weights (target and draft)
PROMPTS = ["Write a Python function that reverses a linked list.", "Explain what a hash table is.",
           "List three uses of the Fourier transform.", "Summarize the plot of Hamlet in two sentences.",
           "What is the capital of Australia, and why not Sydney?", "Give me a haiku about autumn rain.",
           "How do I read a CSV file with pandas?", "Describe the water cycle for a ten-year-old."]


def run(eng: Any, prompts: list[list[int]], tokens: int) -> tuple[float, int, list[Request]]:
    reqs = [Request(f"r{i}", p, SamplingParams(max_tokens=tokens, ignore_eos=True)) for i, p in enumerate(prompts)]
    for r in reqs:
        eng.add_request(r)
    eng.step()  # prefill (and first tokens) outside the clock
    t0 = time.perf_counter()
    while eng.has_work:
        eng.step()
    return time.perf_counter() - t0, sum(len(r.output_ids) - 1 for r in reqs), reqs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--weights", default="int4,int8,float")
    ap.add_argument("--policies", default="incremental,adaserve")
    args = ap.parse_args()
    cells = []
    for label in args.weights.split(","):
        pair = resolve(DEFAULT_MODEL, progress=False, weights=WEIGHTS[label])
        for policy in args.policies.split(","):
            built = build_engine(target=pair.target, draft=pair.draft, policy=policy, budget=32,
                                 weights=WEIGHTS[label], progress=False, profile=False)
            eng, tok = built.engine, built.tokenizer
            prompts = [instruction_ids(tok, p) for p in PROMPTS[: args.concurrency]]
            rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
            for threads in (int(t) for t in args.threads.split(",")):
                torch.set_num_threads(threads)
                run(eng, prompts[:1], 8)  # warm-up
                lone_s, lone_n, lone = run(eng, prompts[:1], args.tokens)
                many_s, many_n, _ = run(eng, prompts, args.tokens)
                cells.append({"weights": label, "served": served_weights(eng.target.model), "policy": policy,
                              "threads": threads, "lone_tpot_ms": round(1e3 * lone_s / lone_n, 2),
                              f"concurrent{args.concurrency}_tokens_per_s": round(many_n / many_s, 1),
                              "target_weight_mb": round(weight_bytes(eng.target.model) / 2**20, 1),
                              "max_rss_mb_after_load": round(rss_mb, 1),
                              "lone_output_head": lone[0].output_ids[:12]})
                print(json.dumps(cells[-1]), flush=True, file=sys.stderr)
    print(json.dumps({"machine": {"cpu": platform.processor() or platform.machine(), "torch": torch.__version__,
                                  "cores": os.cpu_count()},
                      "model": DEFAULT_MODEL, "tokens": args.tokens, "budget": 32, "cells": cells,
                      "peers": "none run (no llama.cpp or Ollama installed here)"}, indent=1))


if __name__ == "__main__":
    main()
