"""The int8 LM head's refinement and greedy draw, two ways, at the default model's head shape (issue 30): what a
verification of M rows pays after the head's product on a CPU's integer kernels. Prints JSON.

    PYTHONPATH=. python scripts/int8-head-bench.py [--rows 1,4,16,32,96] [--repeats 15]

The head's product (``Int8Linear.forward``: 49152 x 576 int8, random codes and scales) is made once per row count;
then, in turn on copies of it, ``repeats`` times each:

    torch    what Int8Head did before head_refine: ``topk`` of each row, the top rows' codes gathered and multiplied
             in float32, scattered back, then the greedy draw's scan (``verify.first_argmax``)
    native   ``NativeKernels.head_refine``: one pass a row, the draw included (Int8Head now)

Reported per M: median, min and max milliseconds of each, the product's own median (what both add to), and at
how many rows the two drew the same token (all, but for a near-tie: they sum the refined products in different
orders). One torch thread.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable

import torch

from adaserve.bench.engine_only import host_cpu, source_version
from adaserve.engine.model import native_kernels as nk
from adaserve.engine.model.quant import Int8Head, Int8Linear, quantize_int8
from adaserve.engine.speculation.verify import first_argmax

HEAD = (49152, 576)
REFINE = 16


def torch_refine(head: Int8Head, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Int8Head's refinement on torch's ops (``Int8Head.refined``, its path without the integer kernels), then the
    greedy draw's scan."""
    return first_argmax(head.refined(y, x))


def timed(fn: Callable[[], object], repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def spread(ms: list[float]) -> dict[str, float]:
    return {"median_ms": statistics.median(ms), "min_ms": min(ms), "max_ms": max(ms)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,4,16,32,96", help="row counts, comma-separated")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--vocab", type=int, default=HEAD[0], help="the head's rows (default SmolLM2's 49152)")
    args = ap.parse_args()
    try:
        rows = [int(r) for r in args.rows.split(",")]
    except ValueError:
        rows = []
    if not rows or min(rows) < 1 or args.repeats < 1 or args.vocab <= REFINE:
        print(f"int8-head-bench: --rows must be positive integers, --repeats >= 1, --vocab > {REFINE}",
              file=sys.stderr)
        return 2
    kernels = nk.kernels()
    if kernels is None:
        print("int8-head-bench: the integer kernels do not build on this machine", file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(args.vocab, HEAD[1], generator=gen) * 0.05
    head = Int8Head(*quantize_int8(w), refine=REFINE)
    head.native = kernels
    report: dict[str, object] = {"benchmark": "int8-head", "source": source_version(), "cpu": host_cpu(),
                                 "threads": 1, "head": [args.vocab, HEAD[1]], "refine": REFINE,
                                 "repeats": args.repeats, "cells": []}
    for m in rows:
        x = torch.randn(m, HEAD[1], generator=gen)
        y = Int8Linear.forward(head, x)
        product = timed(lambda x=x: Int8Linear.forward(head, x), max(3, args.repeats // 3))
        # the two sum the refined products in different orders: a near-tie could draw differently (reported)
        same = torch_refine(head, y.clone(), x) == kernels.head_refine(y.clone(), x, head.qweight, head.scales32,
                                                                        REFINE)
        ways: dict[str, list[float]] = {"torch": [], "native": []}
        for _ in range(args.repeats):  # interleaved: the machine's drift falls on both alike
            a, b = y.clone(), y.clone()
            ways["torch"] += timed(lambda a=a, x=x: torch_refine(head, a, x), 1)
            ways["native"] += timed(lambda b=b, x=x: kernels.head_refine(b, x, head.qweight, head.scales32, REFINE), 1)
        cell = {"rows": m, "same_draws": int(same.sum()), "product_median_ms": statistics.median(product),
                **{f"{k}_{s}": v for k, ms in ways.items() for s, v in spread(ms).items()}}
        report["cells"].append(cell)  # type: ignore[union-attr]
        print(f"{m:3d} rows: torch {cell['torch_median_ms']:.2f} ms, native {cell['native_median_ms']:.2f} ms "
              f"(the product {cell['product_median_ms']:.2f})", file=sys.stderr)
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
