"""``adaserve replay``: the paper's figures on the replay clock (bench/replay_sweep.py, bench/sim/replay.py).

    adaserve replay record --model demo-tiny --trace-json T.json --out pool.npz   real models, once
    adaserve replay run --pool pool.npz --trace-json T1.json T2.json ... --systems vllm,adaserve --seeds 0,1,2
        --jobs 2 --json out.json --plot out.png                                   no model: seconds per cell
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from adaserve.cli_error import CliError

DEFAULT_SYSTEMS = "vllm,sarathi,vllm-spec:4,vllm-spec:6,vllm-spec:8,adaserve"


def add_parser(sub: Any) -> None:
    p = sub.add_parser("replay", help="the paper's figures on the replay clock: recorded acceptance, no model")
    rsub = p.add_subparsers(dest="replay_cmd", required=True)
    rec = rsub.add_parser("record", help="record draft/target agreement with a real model pair on a trace's prompts")
    rec.add_argument("--model", default="demo-tiny", help="demo-tiny (default) or smollm2-135m-instruct (its draft)")
    rec.add_argument("--trace-json", required=True, type=Path,
                     help="an artifact-format trace (its prompts and classes)")
    rec.add_argument("--out", required=True, type=Path, help="the pool file to write (.npz)")
    rec.add_argument("--per-class", type=int, default=40, help="distinct prompts recorded per class (default 40)")
    rec.add_argument("--output-tokens", type=int, help="tokens per recording (default: the trace's output length)")
    rec.add_argument("--seed", type=int, default=0, help="which prompts are drawn")
    rec.set_defaults(func=run_record)
    run = rsub.add_parser("run", help="run traces x systems x seeds on the replay clock; JSON (and a PNG)")
    run.add_argument("--pool", required=True, type=Path, help="an agreement pool from `adaserve replay record`")
    run.add_argument("--trace-json", required=True, type=Path, nargs="+", help="one or more artifact-format traces")
    run.add_argument("--systems", default=DEFAULT_SYSTEMS,
                     help=f"bench systems or engine policies, comma-separated (default {DEFAULT_SYSTEMS})")
    run.add_argument("--seeds", default="0", help="comma-separated seeds (default 0)")
    run.add_argument("--device-profile", default="artifact/llama-3.1-70b", help="a shipped device profile or a file")
    run.add_argument("--baseline-tpot-ms", type=float, default=30.0, help="what a positive slo_ratio multiplies")
    run.add_argument("--max-batch", type=int, default=64, help="running requests, for systems that are not presets")
    run.add_argument("--prefill-chunk", type=int, default=256, help="prompt tokens per iteration, same")
    run.add_argument("--prefill-rule", default="fixed", choices=["fixed", "slo"], help="same")
    run.add_argument("--prefill-ttft-ms", type=float,
                     help="the slo rule's TTFT target for every request, ms from arrival (default: none)")
    run.add_argument("--prompt-lengths", default="trace", choices=["trace", "recorded"],
                     help="the trace's input_length (default) or the recording model's count")
    run.add_argument("--jobs", type=int, default=1, help="cells run at once, one process each")
    run.add_argument("--json", type=Path, help="write the result here (default: stdout)")
    run.add_argument("--plot", type=Path, help="attainment and goodput against rate, one line per system (PNG)")
    run.set_defaults(func=run_sweep)


def _ints(text: str, what: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise CliError(f"--{what}: expected comma-separated integers, got {text!r}") from None


def run_record(args: argparse.Namespace) -> int:
    from adaserve.bench.replay_sweep import record_pool
    from adaserve.engine.loading.catalog import ModelNotFoundError

    if args.per_class < 1 or (args.output_tokens is not None and args.output_tokens < 1):
        raise CliError("--per-class and --output-tokens must be >= 1")
    try:
        pool = record_pool(args.model, str(args.trace_json), args.out, per_class=args.per_class,
                           output_tokens=args.output_tokens, seed=args.seed)
    except (ValueError, FileNotFoundError, ModelNotFoundError) as e:
        raise CliError(str(e)) from None
    print(json.dumps({"pool": str(args.out), "meta": pool.meta, "summary": pool.summary()}, indent=2))
    return 0


def run_sweep(args: argparse.Namespace) -> int:
    from adaserve.bench.replay_sweep import SweepSettings, sweep

    seeds = _ints(args.seeds, "seeds")
    systems = [s for s in args.systems.split(",") if s.strip()]
    if not seeds or not systems:
        raise CliError("give at least one seed and one system")
    if args.jobs < 1 or args.max_batch < 1 or args.prefill_chunk < 1:
        raise CliError("--jobs, --max-batch and --prefill-chunk must be >= 1")
    if args.prefill_ttft_ms is not None and not args.prefill_ttft_ms > 0:
        raise CliError("--prefill-ttft-ms must be > 0")
    settings = SweepSettings(device_profile=args.device_profile, pool=str(args.pool),
                             baseline_tpot_ms=args.baseline_tpot_ms, max_batch=args.max_batch,
                             prefill_chunk=args.prefill_chunk, prefill_rule=args.prefill_rule,
                             prefill_ttft_ms=args.prefill_ttft_ms,
                             prompt_lengths=args.prompt_lengths)
    partial = args.json.with_suffix(".partial.json") if args.json else None

    def keep(cells: list[dict[str, Any]]) -> None:  # a sweep cut short keeps its finished cells
        if partial is not None:
            partial.write_text(json.dumps({"partial": True, "cells": cells}))

    try:
        result = sweep([str(p) for p in args.trace_json], systems, seeds, settings, jobs=args.jobs, on_cell=keep)
    except (ValueError, FileNotFoundError) as e:
        raise CliError(str(e)) from None
    text = json.dumps(result, indent=1)
    if args.json:
        args.json.write_text(text)
        if partial is not None:
            partial.unlink(missing_ok=True)
    else:
        sys.stdout.write(text + "\n")
    if args.plot:
        from adaserve.bench.replay_sweep import plot_points

        plot_points(result["points"], args.plot)
    for row in result["points"]:
        att, good = row["slo_attainment"], row["goodput_window_tok_s"]
        print(f"{row['trace']:>28} {row['axis']} {row['x']:5.2f} {row['system']:>24}: attainment "
              f"{att['mean']:.3f} [{att['min']:.3f}, {att['max']:.3f}]  goodput {good['mean']:7.1f} tok/s",
              file=sys.stderr)
    return 0
