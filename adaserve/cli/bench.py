"""``adaserve bench``: every policy on one arrival schedule, side by side, on the wall clock or a simulated one."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from adaserve.bench.sim.device_model import HOST_MEASURED
from adaserve.cli.arg_types import add_weights_option, floats
from adaserve.cli.reports import emit_report
from adaserve.cli_error import CliError
from adaserve.engine.loading.catalog import DEFAULT_MODEL


def _budgets(text: str) -> tuple[int | str, ...]:
    out: list[int | str] = []
    for x in text.split(","):
        if x == "auto":
            out.append(x)
        elif x.isdigit() and int(x) > 0:
            out.append(int(x))
        else:
            raise argparse.ArgumentTypeError(f"budgets are positive integers or 'auto', got {x!r}")
    return tuple(out)


def _sched(text: str) -> float | str:
    if text == HOST_MEASURED:
        return text
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected milliseconds or 'measured', got {text!r}") from None
    if not v >= 0:
        raise argparse.ArgumentTypeError(f"scheduler time must be >= 0 ms, got {text!r}")
    return v


def add_parser(sub: Any) -> None:
    p = sub.add_parser("bench", help="compare decoding policies on the same multi-SLO workload")
    p.add_argument("--model", default=DEFAULT_MODEL,
                   help=f"{DEFAULT_MODEL} (default, with its distilled draft), demo-tiny, a .gguf file or a directory")
    p.add_argument("--target", help="target model, overriding --model (same forms)")
    add_weights_option(p)  # here: which conversion of a GGUF model is served; directory models run as stored
    p.add_argument("--draft", action="append",
                   help="draft model (default: the named model's own); repeat it for several drafts (policies "
                        "POLICY@ucb|eps|length|dN, spin, spin-eps, spin-length choose among them per request)")
    p.add_argument("--policies", default="adaserve,incremental,chain:4,smartspec,specinfer",
                   help="comma-separated policies (empty with --budgets to sweep budgets only): engine policies, or "
                        "the paper's systems with their own admission and prefill: vllm, sarathi, vllm-spec:K, "
                        "adaserve (the paper's configuration; = adaserve-paper), adaserve+goodput-budget, "
                        "adaserve+slo-prefill, adaserve+learned-values, adaserve+goodput-depth, adaserve+ours "
                        "(the engine's defaults; the bench's adaserve before issue 29); docs/benchmarks.md")
    p.add_argument("--rps", type=floats, help="request rates, comma-separated (default 1)")
    p.add_argument("--duration", type=float, help="seconds of arrivals per (policy, rate) (default 30)")
    p.add_argument("--trace", type=Path, help="arrival trace CSV (Azure format), rescaled to each rate")
    p.add_argument("--trace-json", type=Path,
                   help="the AdaServe artifact's workload file (a JSON list of emission_time_ms, input_length, "
                        "output_length, prompt, slo_ratio): its arrivals, prompts, SLO classes and fixed output "
                        "lengths, in place of --rps, --duration, --mix and --trace")
    p.add_argument("--mix", help="class mix, e.g. coding=0.6,chat=0.2,summarization=0.2")
    p.add_argument("--slo-scale", type=float, default=1.0, help="multiply every class's TPOT SLO")
    p.add_argument("--slo-classes", choices=["relative", "paper"],
                   help="generated workload's SLOs: 1.2x / 2x / 6x the baseline (relative, default), or the paper's "
                        "Table 2, 1.2x the baseline / 50 ms / 150 ms (paper)")
    p.add_argument("--output-tokens", type=int,
                   help="every request decodes exactly this many tokens, end-of-sequence ignored, as the paper's "
                        "traces do (256); default: drawn per class, or from --trace, capped by --max-tokens")
    p.add_argument("--budgets", type=_budgets, default=(), help="also run adaserve at these budgets (and 'auto')")
    p.add_argument("--budget", type=int, help="fixed budget for every policy (default: profiled)")
    p.add_argument("--baseline-tpot-ms", type=float,
                   help="unloaded per-token latency the SLOs are multiples of (default: measured now; with "
                        "--trace-json 30, the artifact's BASELINE_LATENCY_PER_TOKEN_MS for Llama-3.1-70B)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--max-tokens", type=int,
                   help="cap on output tokens per request (default 128; with --trace-json none: its lengths)")
    p.add_argument("--max-prompt-tokens", type=int,
                   help="prompts longer than this keep their last tokens (the chat template's opening survives; "
                        "default 512; with --trace-json as many as the models' context leaves, always at most that)")
    p.add_argument("--max-batch", type=int, default=64,
                   help="requests running at once (the engine's max_batch); later arrivals wait in its queue")
    p.add_argument("--prefix-caching", action="store_true",
                   help="reuse cached prompt prefixes' KV (off in the bench: it draws prompts with replacement, and a "
                        "repeated prompt would skip its prefill in every system)")
    p.add_argument("--compare-prefix-caching", action="store_true",
                   help="run every policy twice on the same arrivals, without and with prefix caching (the cached "
                        "rows labelled 'NAME (prefix cache)'); outputs are checked against one reference")
    p.add_argument("--conversations", type=int, metavar="N",
                   help="multi-turn chat in place of the generated workload: N conversations started at each --rps "
                        "(conversations/s), sharing one system prompt; each later turn is sent --think-s after the "
                        "answer before it and resends the whole conversation (answers --output-tokens long, else "
                        "--max-tokens, end-of-sequence ignored)")
    p.add_argument("--turns", type=int, help="with --conversations: turns per conversation (default 2)")
    p.add_argument("--think-s", type=float,
                   help="with --conversations: seconds between an answer and the next turn (default 1)")
    p.add_argument("--system-chars", type=int,
                   help="with --conversations: the shared system prompt's length in characters (default 2400)")
    p.add_argument("--prefill-rule", choices=["fixed", "slo"], default="fixed",
                   help="prompt tokens per iteration: the fixed chunk, or shrunk while decoding requests' TPOT "
                        "SLOs need it (slo; every policy)")
    p.add_argument("--clock", choices=["wall", "simulated"], default="wall",
                   help="simulated: real models and tokens, time from --device-profile (deterministic)")
    p.add_argument("--device-profile", default="measured",
                   help="simulated clock's device: 'measured' (this machine's profile), a shipped profile "
                        "(e.g. a100-80g-tp4/llama-3.1-70b) or a JSON file")
    p.add_argument("--sched-ms", type=_sched,
                   help="simulated: scheduler time per iteration in ms, or 'measured' (host time; default for "
                        "the measured profile, else the profile's figure)")
    p.add_argument("--sweep", choices=["rate", "urgent-share", "slo-scale"], default="rate",
                   help="what varies: --rps (rate), or --values at the one --rps")
    p.add_argument("--values", type=floats, default=(), help="urgent shares or SLO scales for --sweep")
    p.add_argument("--tensor-parallel-size", type=int, default=1, metavar="N",
                   help="shard the target over N ranks, one process per device (CPU: gloo; the drafts stay whole)")
    p.add_argument("--json", type=Path, help="write the report here")
    p.add_argument("--plot", type=Path, help="attainment and goodput against rate (PNG)")
    p.set_defaults(func=run)


def check_trace_json(args: argparse.Namespace) -> None:
    """A trace-json file must be readable and whole before any model loads, and sets what these options would."""
    from adaserve.bench.emission_trace import read_emission_trace

    clash = [flag for flag, v in (("--rps", args.rps), ("--duration", args.duration), ("--mix", args.mix),
                                  ("--trace", args.trace), ("--slo-classes", args.slo_classes),
                                  ("--output-tokens", args.output_tokens)) if v is not None]
    if clash:
        raise CliError(f"{', '.join(clash)} cannot be combined with --trace-json: the trace sets the workload")
    try:
        read_emission_trace(args.trace_json)
    except ValueError as e:
        raise CliError(str(e)) from None


def check_conversations(args: argparse.Namespace) -> None:
    """--conversations replaces the generated workload: the options only it reads need it, and the ones it
    replaces may not come with it."""
    if args.conversations is None:
        given = [flag for flag, v in (("--turns", args.turns), ("--think-s", args.think_s),
                                      ("--system-chars", args.system_chars)) if v is not None]
        if given:
            raise CliError(f"{', '.join(given)} only apply with --conversations")
        return
    clash = [flag for flag, v in (("--duration", args.duration), ("--trace-json", args.trace_json)) if v is not None]
    if clash:
        raise CliError(f"{', '.join(clash)} cannot be combined with --conversations: the conversations' count and "
                       "--rps set the workload")
    from adaserve.bench.workload import MultiTurnConfig

    try:
        MultiTurnConfig(conversations=args.conversations, **chat_settings(args))
    except ValueError as e:
        raise CliError(f"--conversations: {e}") from None


def chat_settings(args: argparse.Namespace) -> dict[str, Any]:
    """--turns, --think-s and --system-chars as given, else the multi-turn workload's defaults."""
    from adaserve.bench.workload import MultiTurnConfig

    given = {"turns": args.turns, "think_s": args.think_s, "system_chars": args.system_chars}
    return {k: getattr(MultiTurnConfig, k) if v is None else v for k, v in given.items()}


def run(args: argparse.Namespace) -> int:
    check_conversations(args)
    if args.prefix_caching and args.compare_prefix_caching:
        raise CliError("--prefix-caching and --compare-prefix-caching: give one (the second runs both)")
    if args.trace_json is not None:
        check_trace_json(args)
    from adaserve.bench.runner import BenchConfig, plot_report, run_bench
    from adaserve.bench.workload import parse_mix
    from adaserve.engine.build import EngineBuildError
    from adaserve.engine.loading.catalog import ModelNotFoundError, resolve_drafts
    from adaserve.engine.model.config import UnsupportedModelError
    from adaserve.engine.ranks import check_size

    # without a trace-json file, the generated workload's defaults; with one, the trace's own lengths
    free = args.trace_json is not None
    max_tokens = args.max_tokens if args.max_tokens is not None or free else 128
    max_prompt_tokens = args.max_prompt_tokens if args.max_prompt_tokens is not None or free else 512
    try:
        check_size(args.target or args.model, args.tensor_parallel_size)  # before a GGUF model is converted
        pair, extra = resolve_drafts(args.target or args.model, args.draft or (), weights=args.weights)
    except (ModelNotFoundError, ValueError, UnsupportedModelError) as e:
        raise CliError(str(e)) from None
    if pair.draft is None:
        raise CliError(f"{pair.name} has no draft of its own: give one with --draft")
    try:
        policies = tuple(p for p in args.policies.split(",") if p)
        cfg = BenchConfig(target=pair.target, draft=pair.draft, extra_drafts=extra, model=pair.name, policies=policies,
                          rates=(1.0,) if args.rps is None else args.rps,
                          duration_s=30.0 if args.duration is None else args.duration, trace=args.trace,
                          trace_json=args.trace_json,
                          mix=parse_mix(args.mix) if args.mix else None, slo_scale=args.slo_scale,
                          slo_classes=args.slo_classes or "relative", output_tokens=args.output_tokens,
                          seed=args.seed, device=args.device, budget=args.budget, budgets=args.budgets,
                          max_tokens_cap=max_tokens, max_prompt_tokens=max_prompt_tokens,
                          max_batch=args.max_batch, prefill_rule=args.prefill_rule,
                          prefix_caching=args.prefix_caching, compare_prefix_caching=args.compare_prefix_caching,
                          conversations=args.conversations, **chat_settings(args),
                          baseline_tpot_ms=args.baseline_tpot_ms,
                          clock=args.clock, device_profile=args.device_profile, sched_ms=args.sched_ms,
                          sweep=args.sweep, values=args.values, tensor_parallel_size=args.tensor_parallel_size)
        if args.trace is not None and not args.trace.is_file():
            raise ValueError(f"trace {args.trace} does not exist")
        report = run_bench(cfg)
    except (ValueError, FileNotFoundError, UnsupportedModelError, EngineBuildError) as e:
        raise CliError(str(e)) from None
    emit_report(report, json_path=args.json, plot_path=args.plot, plot=plot_report)
    return 0
