"""Greedy equality on a GPU: speculative policies against incremental decoding, per dtype and backend.

Incremental decoding is the target alone; each speculative policy must produce the same tokens. In fp32
they must be identical. In bf16/fp16 a batched tree forward and a one-token forward round differently,
so a genuine near-tie can flip: for every request whose output differs, the fp32 torch-backend target
rates the two tokens at the first divergence (same context). A near-tie (gap small against the largest
|logit|) is half-precision rounding; a large gap would be a bug in masks, pages or verification.

    python scripts/gpu-lossless.py OUT.json [--device cuda]     (part of scripts/gpu-checklist.sh)
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

import torch

from adaserve.engine.config import EngineConfig
from adaserve.engine.engine import Engine
from adaserve.engine.loading.catalog import resolve
from adaserve.engine.loading.loader import load_model
from adaserve.engine.model.batch import Segment
from adaserve.engine.model.kv_cache import KVCacheConfig, SequenceKV
from adaserve.engine.model.runner import ModelRunner
from adaserve.engine.model.tree import TokenTree
from adaserve.engine.request import Request
from adaserve.engine.speculation.sampling import SamplingParams

POLICIES = ("adaserve", "beam:4,2", "chain:4")
CASES = (("torch", torch.float32), ("torch", torch.bfloat16), ("flashinfer", torch.bfloat16),
         ("flashinfer", torch.float16))
Outputs = dict[str, tuple[list[int], list[int]]]  # request id -> (prompt, output)


def runner(path: Path, attention: str, dtype: torch.dtype, device: torch.device) -> ModelRunner:
    return ModelRunner(load_model(path, device=device, dtype=dtype),
                       EngineConfig(attention=attention, kv=KVCacheConfig(page_size=16, num_pages=4000)))


def workload(n: int = 24, seed: int = 0) -> list[Request]:
    rng = random.Random(seed)
    return [Request(f"r{i}", [rng.randrange(3, 500) for _ in range(rng.randrange(8, 120))],
                    SamplingParams(max_tokens=96, ignore_eos=True)) for i in range(n)]


def generate(policy: str, attention: str, dtype: torch.dtype, device: torch.device) -> tuple[Outputs, float]:
    """Every request to its cap; three arrive at once, then one joins per step."""
    pair = resolve("demo-tiny")
    assert pair.draft is not None
    draft = None if policy == "incremental" else runner(pair.draft, attention, dtype, device)
    eng = Engine(runner(pair.target, attention, dtype, device), draft,
                 EngineConfig(policy=policy, budget=64, prefill_chunk=256, attention=attention))
    reqs = workload()
    pending = list(reqs)
    t0 = time.perf_counter()
    while pending or eng.has_work:
        for _ in range(4 if len(pending) == len(reqs) else 1):  # the first step sees four, then one joins a step
            if pending:
                eng.add_request(pending.pop(0))
        eng.step()
    return {r.request_id: (r.prompt_ids, r.output_ids) for r in reqs}, time.perf_counter() - t0


def relative_gap(oracle: ModelRunner, prompt: list[int], a: list[int], b: list[int], i: int) -> float:
    """|logit(a_i) - logit(b_i)| / max |logit| of the fp32 target after prompt + a[:i]."""
    seq = SequenceKV()
    logits = oracle.forward([Segment(seq, 0, TokenTree.chain(prompt + a[:i]))], all_logits=[False])[0][0]
    oracle.cache.release(seq)
    return float((logits[a[i]] - logits[b[i]]).abs() / logits.abs().max())


def compare(ref: Outputs, got: Outputs, oracle: ModelRunner) -> list[dict[str, Any]]:
    diverged = []
    for rid, (prompt, a) in got.items():
        b = ref[rid][1]
        i = next((j for j, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)
        if i is not None:
            diverged.append({"request": rid, "at": i, "relative_logit_gap_fp32": relative_gap(oracle, prompt, a, b, i)})
    return diverged


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path)
    p.add_argument("--device", default="cuda")
    args = p.parse_args()
    device = torch.device(args.device)
    oracle = runner(resolve("demo-tiny").target, "torch", torch.float32, device)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    report: dict[str, Any] = {"device": name, "torch": torch.__version__, "model": "demo-tiny",
                              "workload": "24 random prompts of 8-119 tokens, 96 tokens each, budget 64",
                              "cases": []}
    for attention, dtype in CASES:
        if device.type != "cuda" and (attention == "flashinfer" or dtype != torch.float32):
            continue
        dt = str(dtype).removeprefix("torch.")
        try:
            ref, t_ref = generate("incremental", attention, dtype, device)
            for policy in POLICIES:
                got, t = generate(policy, attention, dtype, device)
                diverged = compare(ref, got, oracle)
                case = {"attention": attention, "dtype": dt, "policy": policy, "requests": len(got),
                        "equal_share": 1 - len(diverged) / len(got),
                        "max_relative_gap": max((d["relative_logit_gap_fp32"] for d in diverged), default=None),
                        "diverged": diverged, "wall_s": t, "wall_s_incremental": t_ref}
                report["cases"].append(case)
                print(attention, dt, policy, "equal", round(case["equal_share"], 3),
                      "max gap", case["max_relative_gap"], flush=True)
        except Exception as e:  # a backend this machine lacks: record it, go on with the others
            report["cases"].append({"attention": attention, "dtype": dt, "error": repr(e)})
            print("ERROR", attention, dt, repr(e), file=sys.stderr, flush=True)
        args.out.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
