"""The integer kernels' products at the default model's shapes (issue 35): what one token's int4 layers and its int8
head cost at 1..16 rows, one thread, weights beyond the caches. Prints JSON.

    PYTHONPATH=. python scripts/integer-kernels-bench.py [--library OLD.so --library NEW.so]

Thirty blocks of SmolLM2-135M's four int4 products (q/k/v joined 960x576, o 576x576, gate/up joined 3072x576,
down 576x1536: ~80 MB with their block scales) are multiplied in turn by M activation rows, then the 49152x576
int8 head once; best of ``--repeats``. Random codes and scales: a product's time does not depend on the values.
Without ``--library`` the kernels this checkout builds (native_kernels.kernels()) are timed; with several, each
given build (for instance one compiled from an earlier commit's sources) in turn, and the outputs are checked to
be bitwise the same across them.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from adaserve.bench.engine_only import host_cpu, source_version
from adaserve.engine.model import native_kernels as nk

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # (N, K) of one block's int4 products
LAYERS = 30
HEAD = (49152, 576)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--library", type=Path, action="append", help="a built kernel library (repeatable)")
    ap.add_argument("--rows", default="1,2,3,4,5,8,16")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.library:
        libs = {str(p): nk.load(p) for p in args.library}
    else:
        built = nk.kernels()
        if built is None:
            raise SystemExit("integer-kernels-bench: the integer kernels do not build on this machine")
        libs = {str(built.path): built}
    gen = torch.Generator().manual_seed(0)
    layers = [(nk.q4_blocks(torch.randint(0, 16, (n, k), generator=gen)), torch.rand(n, k // 32, generator=gen),
               torch.randn(n, k // 32, generator=gen), k) for _ in range(LAYERS) for n, k in SHAPES]
    head = (torch.randint(-127, 128, HEAD, dtype=torch.int8, generator=gen), torch.rand(HEAD[0], generator=gen))
    cells = []
    for m in (int(r) for r in args.rows.split(",")):
        xs = {k: torch.randn(m, k, generator=gen) for _, k in SHAPES}
        outputs = []
        for name, lib in libs.items():
            best_q4 = best_head = float("inf")
            for _ in range(args.repeats):
                t = time.perf_counter()
                ys = [lib.mm_q4(xs[k], w, d, mins) for w, d, mins, k in layers]
                best_q4 = min(best_q4, time.perf_counter() - t)
                t = time.perf_counter()
                yh = lib.mm_q8(xs[HEAD[1]], *head)
                best_head = min(best_head, time.perf_counter() - t)
            outputs.append((ys, yh))
            cells.append({"library": name, "rows": m, "int4_products_ms": round(best_q4 * 1e3, 3),
                          "int8_head_ms": round(best_head * 1e3, 3)})
        same = all(all(torch.equal(a, b) for a, b in zip(o[0], outputs[0][0], strict=True))
                   and torch.equal(o[1], outputs[0][1]) for o in outputs)
        for c in cells[-len(libs):]:
            c["bitwise_same_as_first"] = same
    print(json.dumps({"benchmark": "integer-kernels", "source": source_version(), "cpu": host_cpu(),
                      "flags": list(nk.build_flags()), "threads": 1, "repeats": args.repeats,
                      "int4_products_per_token": LAYERS * len(SHAPES), "cells": cells}, indent=2))


if __name__ == "__main__":
    main()
