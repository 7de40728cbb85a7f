"""Host time of a static-shape forward outside the model: what a GPU's draft or decode step pays on the host
around its graph replay (building the layout, filling the bucket's buffers, picking the logits rows).

On a CPU the static path calls the captured function eagerly; the model's own time is taken out with the
module clock that ``adaserve microbench`` uses, so what remains is the host work a replay would not hide.
Random weights of a published or given architecture (times do not depend on the values). Prints JSON: per
batch size, the median and spread of microseconds outside the model per forward (1 new token a request).

    python scripts/static-host-time.py --arch models/smollm2-draft/config.json --batches 1,8,32 --forwards 400
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from adaserve.bench.engine_only import ForwardClock, host_cpu, source_version
from adaserve.bench.random_arch import DecodeProbe, _segments, random_model, runner_for
from adaserve.engine.model.runner import ModelRunner


def outside_us(runner: ModelRunner, batch: int, context: int, forwards: int, warmup: int) -> list[float]:
    clock = ForwardClock(runner.model)
    out = []
    try:
        with _segments(runner, DecodeProbe(batch, 1, context)) as segs:
            flags = [True] * batch
            for i in range(warmup + forwards):
                f0 = clock.seconds
                t0 = time.perf_counter()
                runner.forward(segs, all_logits=flags)
                t = time.perf_counter() - t0
                if i >= warmup:
                    out.append(1e6 * (t - (clock.seconds - f0)))
    finally:
        clock.remove()
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arch", default="models/smollm2-draft/config.json", help="an architecture name or config.json")
    p.add_argument("--batches", default="1,8,32")
    p.add_argument("--context", type=int, default=256, help="cached tokens per request")
    p.add_argument("--forwards", type=int, default=400)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    arch = json.loads(Path(args.arch).read_text()) if args.arch.endswith(".json") else args.arch
    model = random_model(arch, device=torch.device("cpu"), dtype=torch.float32)
    runner = runner_for(model, kv_bytes=64 << 20, static_shapes=True)
    cells = []
    for b in (int(x) for x in args.batches.split(",") if x):
        xs = sorted(outside_us(runner, b, args.context, args.forwards, args.warmup))
        cells.append({"batch": b, "median_us": round(statistics.median(xs), 1), "p10_us": round(xs[len(xs) // 10], 1),
                      "p90_us": round(xs[9 * len(xs) // 10], 1)})
    json.dump({"benchmark": "static-host-time", "source": source_version(), "cpu": host_cpu(),
               "settings": {**vars(args), "dtype": "float32", "device": "cpu", "new_tokens": 1}, "cells": cells},
              sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
