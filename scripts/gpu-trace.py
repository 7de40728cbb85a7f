"""Where a GPU iteration's time goes (issue 30): kernels of one static-shape forward, and the host's Python in
speculative iterations. Random bf16 weights of the default pair's architectures (adaserve/bench/random_arch.py):
kernel times do not depend on the values; the speculative trees do, so the host profile shows the code's
structure, not the real pair's tree sizes.

    python scripts/gpu-trace.py --device cuda --out DIR

Writes DIR/kernels-b{1,32}.txt (torch.profiler's table of the forward's kernels, run eagerly through the
very function a graph captures, 20 forwards), DIR/host-{adaserve,beam-4-2}-b{1,32}.txt (cProfile of 20 speculative
iterations with graphs, sorted by cumulative and by own time) and DIR/trace-summary.json. On a CPU it runs
the same steps on a tiny architecture (the script's plumbing).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import sys
import time
from pathlib import Path

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile

from adaserve.bench.random_arch import ARCHITECTURES, DecodeProbe, _segments, random_model, runner_for
from adaserve.engine.config import EngineConfig
from adaserve.engine.engine import Engine
from adaserve.engine.request import Phase, Request
from adaserve.engine.speculation.sampling import SamplingParams

DRAFT = {**ARCHITECTURES["smollm2-135m"], "hidden_size": 256, "intermediate_size": 1024, "num_hidden_layers": 4,
         "num_attention_heads": 4, "num_key_value_heads": 2}  # models/smollm2-draft's shape


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def kernels(target: torch.nn.Module, dev: torch.device, batch: int, out: Path) -> dict[str, float]:
    runner = runner_for(target, kv_bytes=2**30, static_shapes=True)
    assert runner.static is not None
    with _segments(runner, DecodeProbe(batch, 1, 256)) as segs:
        flags = [True] * len(segs)
        runner.forward(segs, all_logits=flags)  # captures the bucket's graph on CUDA
        times = {}
        for graphs in (True, False):
            runner.static.graphs = graphs and dev.type == "cuda"
            for _ in range(3):
                runner.forward(segs, all_logits=flags)
            sync(dev)
            t0 = time.perf_counter()
            for _ in range(20):
                runner.forward(segs, all_logits=flags)
            sync(dev)
            times["graph_ms" if graphs else "eager_static_ms"] = (time.perf_counter() - t0) / 20 * 1e3
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
        with profile(activities=acts) as prof:
            for _ in range(20):
                runner.forward(segs, all_logits=flags)
            sync(dev)
    sort = "cuda_time_total" if dev.type == "cuda" else "cpu_time_total"
    (out / f"kernels-b{batch}.txt").write_text(prof.key_averages().table(sort_by=sort, row_limit=40))
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    times["kernels_per_forward"] = len(events) / 20
    times["kernel_ms_per_forward"] = sum(e.device_time for e in events) / 20 / 1e3
    return times


def host(target: torch.nn.Module, draft: torch.nn.Module, batch: int, policy: str, out: Path) -> dict[str, float]:
    cfg = EngineConfig(policy=policy, budget=64, max_batch=64, static_shapes=True)
    eng = Engine(runner_for(target, kv_bytes=2**30, static_shapes=True),
                 runner_for(draft, kv_bytes=2**30, static_shapes=True), cfg)
    rng = np.random.default_rng(0)
    for i in range(batch):
        ids = rng.integers(10, 40000, 128).tolist()
        eng.add_request(Request(f"r{i}", ids, SamplingParams(max_tokens=400, ignore_eos=True)))
    while eng.waiting or any(r.phase is not Phase.DECODE for r in eng.running):
        eng.step()
    for _ in range(5):
        eng.step()
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    for _ in range(20):
        eng.step()
    prof.disable()
    wall = (time.perf_counter() - t0) / 20 * 1e3
    text = io.StringIO()
    for key in ("cumulative", "tottime"):
        pstats.Stats(prof, stream=text).sort_stats(key).print_stats(45)
    (out / f"host-{policy.replace(':', '-').replace(',', '-')}-b{batch}.txt").write_text(text.getvalue())
    hist = list(eng.history)[-20:]
    return {"iteration_ms_under_cprofile": wall,
            "tokens_per_iteration": sum(m.tokens_emitted for m in hist) / 20,
            "speculate_ms": 1e3 * sum(m.t_speculate_s for m in hist) / 20,
            "verify_ms": 1e3 * sum(m.t_verify_s for m in hist) / 20}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", choices=["cpu", "cuda"])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--batches", default="1,32")
    args = p.parse_args()
    dev = torch.device(args.device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    arch = ARCHITECTURES["smollm2-135m"]
    if dev.type == "cpu":  # the plumbing only
        arch = {**DRAFT, "num_hidden_layers": 2}
    target = random_model(arch, device=dev, dtype=dtype)
    draft = random_model(DRAFT, device=dev, dtype=dtype, seed=1)
    args.out.mkdir(parents=True, exist_ok=True)
    summary: dict[str, object] = {"device": str(torch.cuda.get_device_name() if dev.type == "cuda" else "cpu")}
    for b in (int(x) for x in args.batches.split(",")):
        summary[f"forward_b{b}"] = kernels(target, dev, b, args.out)
        print(json.dumps({f"forward_b{b}": summary[f"forward_b{b}"]}), file=sys.stderr)
        for policy in ("adaserve", "beam:4,2"):  # random weights make adaserve's trees shallow; beam keeps d = 4
            summary[f"{policy}_b{b}"] = host(target, draft, b, policy, args.out)
            print(json.dumps({f"{policy}_b{b}": summary[f"{policy}_b{b}"]}), file=sys.stderr)
    (args.out / "trace-summary.json").write_text(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
