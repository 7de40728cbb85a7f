"""``adaserve profile``: the roofline table, the chosen budget B and the cost-model fit, as JSON."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from adaserve.cli.arg_types import add_weights_option
from adaserve.cli_error import CliError


def add_parser(sub: Any) -> None:
    p = sub.add_parser("profile", help="profile the device: token budget and cost model (cached)")
    p.add_argument("--target", default="smollm2-135m-instruct",
                   help="smollm2-135m-instruct (default, with its draft), demo-tiny, a .gguf file or a directory")
    p.add_argument("--draft", help="draft model, same forms (default: the named model's own)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--attention", default="auto", choices=["auto", "torch", "flashinfer"])
    p.add_argument("--max-tokens", type=int, help="largest n probed (default 256 on CPU, 1024 on CUDA)")
    p.add_argument("--context", type=int, default=256, help="context tokens per request while probing")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--force", action="store_true", help="ignore the cached profile and measure again")
    p.add_argument("--json", action="store_true", help="print the full profile as JSON")
    p.add_argument("--plot", type=Path, help="draw latency and tokens/s against n with the knee (PNG)")
    # the worker's default (worker/settings.py): the cache's size decides the sequences a long-context probe spreads
    # over (profiler.probe_plan), part of the profile's key, so a profile measured here is the one ``adaserve up`` reads
    p.add_argument("--kv-memory-mb", type=int, default=256, help="KV cache memory per model, in MiB (default 256, "
                   "the worker's: its profile is the one measured here)")
    p.add_argument("--tensor-parallel-size", type=int, default=1, metavar="N",
                   help="profile the target sharded over N ranks (CPU: gloo): its own budget and cost model")
    add_weights_option(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from adaserve.engine.build import EngineBuildError, resolve_device
    from adaserve.engine.config import EngineConfig
    from adaserve.engine.cost.profiler import ProfilerConfig, plot_profile, profile_models
    from adaserve.engine.loading.catalog import ModelNotFoundError, resolve
    from adaserve.engine.loading.loader import load_model
    from adaserve.engine.model.config import UnsupportedModelError
    from adaserve.engine.model.kv_cache import KVCacheConfig
    from adaserve.engine.model.runner import ModelRunner
    from adaserve.engine.ranks import check_size, start_target

    try:
        check_size(args.target, args.tensor_parallel_size)  # before a GGUF model is converted
        pair = resolve(args.target, draft=args.draft, weights=args.weights)
        cfg = ProfilerConfig(max_tokens=args.max_tokens, context=args.context, repeats=args.repeats)
        dev = resolve_device(args.device)
        rc = EngineConfig(attention=args.attention, kv=KVCacheConfig(memory_bytes=args.kv_memory_mb * 2**20))
        if args.tensor_parallel_size != 1:  # the sharded engine is measured, cached under its size
            target: ModelRunner = start_target(pair.target, args.tensor_parallel_size, device=dev, settings=rc,
                                               progress=True, weights=args.weights)
        else:
            target = ModelRunner(load_model(pair.target, device=dev, progress=True, weights=args.weights), rc)
        draft = (ModelRunner(load_model(pair.draft, device=dev, progress=True, weights=args.weights), rc)
                 if pair.draft else None)
    except (ValueError, FileNotFoundError, UnsupportedModelError, EngineBuildError, ModelNotFoundError) as e:
        raise CliError(str(e)) from None
    try:
        prof = profile_models(target, draft, target_path=pair.target, draft_path=pair.draft, cfg=cfg,
                              force=args.force)
    finally:
        target.close()  # a tensor-parallel target stops its other ranks
    if args.plot:
        plot_profile(prof.data, args.plot)
    if args.json:
        print(json.dumps(prof.to_dict(), indent=2))
    else:
        t = prof.data["target"]
        how = "cached" if prof.cached else f"profiled in {prof.data['profiling_seconds']:.1f}s"
        print(f"device {prof.device}: budget B = {prof.budget} tokens ({how})")
        if prof.budget > prof.knee:
            print(f"  the knee is at {prof.knee}; B is raised to {prof.budget}, what one request needs to speculate")
        if prof.problems:
            print(f"  warning: the table is too noisy to cache; used for this run only: {'; '.join(prof.problems[:3])}")
        for row in t["table"]:
            print(f"  n={row['n_tokens']:5d}  {row['latency_ms']:9.2f} ms  {row['tokens_per_s']:10.1f} tok/s")
        cm, fit = t["cost_model"], t["fit"]
        cells = f" + {cm['beta']:.3g}*N_cells" if cm.get("beta") else ""  # the attention cells, where fitted
        print(f"  T_fwd = {cm['alpha']:.3g}*N_ctx{cells} + {cm['gamma']:.3g}*N_batched + {cm['delta']:.3g} s"
              f"  (mean rel. error {fit['mean_rel_error']:.1%})", file=sys.stdout)
    return 0
