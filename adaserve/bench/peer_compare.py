"""The engine against Hugging Face transformers' ``generate``: same model, dtype, threads and arrivals, one run.

Scenarios, each repeated; within a repeat every variant runs once, back to back, so they share the
machine's conditions and their ratios are taken repeat by repeat:

    single       one request (a HumanEval task through the chat template), up to ``max_tokens``, greedy
    concurrent   ``concurrency`` requests, all arriving at once (or Poisson at ``arrival_rate``), each
                 with its own prompt and a cap drawn from [min_tokens, max_tokens]; greedy, EOS ends one

Variants:

    engine-adaserve     the engine with AdaServe speculation on the draft (fixed budget, adaptive tree)
    engine-incremental  the engine without speculation (continuous batching)
    hf                  ``generate`` with its default (dynamic) cache: the requests that have arrived go in
                        as one left-padded batch that runs until its longest request is done (bench/hf_peer.py)
    hf-static           the same with ``cache_implementation="static"``
    hf-assisted         (single only) transformers' own speculative decoding with the same draft

Per run: makespan (first arrival to last token), output tokens, throughput = tokens / makespan, per-token
latency (mean TPOT, (t_last - t_first) / (n - 1)), mean TTFT, and the share of requests whose tokens equal
engine-incremental's (greedy: equal up to float differences of batched, padded computation). Also, where
the time goes: one forward over a tree of m tokens against one token (``forward_cpu_ms_by_tokens``), which
prices what a verification costs on this machine, with the engine's few-row kernels and with F.linear
everywhere (as transformers computes).

    python -m adaserve.bench.peer_compare --json docs/results/hf-peer-cpu-smollm2.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from adaserve.bench.engine_only import load_pair, prompts, set_threads, settings, write_report
from adaserve.bench.hf_peer import HFPeer
from adaserve.bench.microbench_options import PeerConfig, add_common, add_engine_only, add_peer, peer_config
from adaserve.engine.config import EngineConfig
from adaserve.engine.engine import Engine
from adaserve.engine.loading.catalog import resolve
from adaserve.engine.model.batch import Segment
from adaserve.engine.model.few_rows import plain_linear
from adaserve.engine.model.kv_cache import SequenceKV
from adaserve.engine.model.runner import ModelRunner
from adaserve.engine.model.tree import TokenTree
from adaserve.engine.request import Request
from adaserve.engine.speculation.sampling import SamplingParams

ENGINE_POLICIES = {"engine-adaserve": "adaserve", "engine-incremental": "incremental"}
HF_VARIANTS = {"hf": dict(assisted=False, cache_implementation=None),
               "hf-static": dict(assisted=False, cache_implementation="static"),
               "hf-assisted": dict(assisted=True, cache_implementation=None)}
REFERENCE = "engine-incremental"

Arrivals = list[tuple[float, Request]]


def scenario_arrivals(ids: list[list[int]], caps: list[int], offsets: list[float]) -> Callable[[], Arrivals]:
    """Fresh requests for every run (a request carries its own output and times)."""
    def make() -> Arrivals:
        return [(t, Request(f"r{i}", p, SamplingParams(max_tokens=c)))
                for i, (p, c, t) in enumerate(zip(ids, caps, offsets, strict=True))]
    return make


def summarize_run(arrivals: Arrivals) -> dict[str, Any]:
    reqs = [r for _, r in arrivals]
    start = min(r.metrics.arrival_s for r in reqs)
    end = max(r.metrics.last_token_s or start for r in reqs)
    tokens = sum(len(r.output_ids) for r in reqs)
    tpots = [r.metrics.tpot_ms for r in reqs if r.metrics.tpot_ms is not None]
    ttfts = [r.metrics.ttft_ms for r in reqs if r.metrics.ttft_ms is not None]
    accepted = [a for r in reqs for a in r.metrics.accepted_per_step]  # the engine's verifications only
    return {"makespan_s": end - start, "output_tokens": tokens, "throughput_tok_s": tokens / (end - start),
            "mean_tpot_ms": statistics.fmean(tpots) if tpots else None,
            "mean_ttft_ms": statistics.fmean(ttfts) if ttfts else None,
            "verifications": len(accepted),
            "accepted_per_verification": statistics.fmean(accepted) if accepted else None}


def run_engine(target: ModelRunner, draft: ModelRunner, policy: str, arrivals: Arrivals, budget: int) -> float:
    """Serve ``arrivals``; returns the engine's own cost over the run: its time outside model forwards as a
    share of its iterations' wall time (StepMetrics), prefill and admission included."""
    eng = Engine(target, draft if policy != "incremental" else None,
                 EngineConfig(policy=policy, budget=budget, max_batch=max(64, len(arrivals)),
                              history_len=1_000_000))
    eng.run(arrivals)
    wall = sum(m.t_wall_s for m in eng.history)
    return 1.0 - sum(m.t_forward_s for m in eng.history) / wall if wall > 0 else 0.0


def run_variant(name: str, make: Callable[[], Arrivals], target: ModelRunner, draft: ModelRunner,
                hf: HFPeer, budget: int) -> tuple[dict[str, Any], dict[str, list[int]]]:
    arrivals = make()
    own: dict[str, float] = {}
    c0 = time.process_time()
    if name in ENGINE_POLICIES:
        own["non_forward_share"] = run_engine(target, draft, ENGINE_POLICIES[name], arrivals, budget)
    else:
        hf.variant(**HF_VARIANTS[name]).run(arrivals, max_batch=len(arrivals))
    cpu = time.process_time() - c0
    summary = summarize_run(arrivals)
    # CPU time is what a shared machine does not inflate (with one torch thread): per output token, prefill
    # included, and tokens per CPU second (the throughput of a machine doing nothing else)
    own |= {"cpu_s": cpu, "cpu_ms_per_token": 1e3 * cpu / summary["output_tokens"],
            "tokens_per_cpu_s": summary["output_tokens"] / cpu}
    return {**summary, **own}, {r.request_id: r.output_ids for _, r in arrivals}


def ratio_stats(xs: list[float]) -> dict[str, float]:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}


def run_scenario(name: str, variants: list[str], make: Callable[[], Arrivals], target: ModelRunner,
                 draft: ModelRunner, hf: HFPeer, cfg: PeerConfig, *, progress: bool) -> dict[str, Any]:
    repeats: list[dict[str, Any]] = []
    for rep in range(cfg.repeats):
        runs, outputs = {}, {}
        for v in variants:
            runs[v], outputs[v] = run_variant(v, make, target, draft, hf, cfg.budget)
            if progress:
                s = runs[v]
                tpot = f"{s['mean_tpot_ms']:.1f}" if s["mean_tpot_ms"] is not None else "-"
                print(f"[{rep + 1}/{cfg.repeats}] {name} {v:18s} {s['throughput_tok_s']:7.1f} tok/s, "
                      f"TPOT {tpot} ms, {s['output_tokens']} tokens in {s['makespan_s']:.1f} s", file=sys.stderr)
        ref = outputs[REFERENCE]
        for v in variants:
            runs[v]["outputs_equal_reference"] = sum(outputs[v][k] == ref[k] for k in ref) / len(ref)
        repeats.append(runs)
    keys = ("throughput_tok_s", "mean_tpot_ms", "makespan_s", "mean_ttft_ms", "accepted_per_verification",
            "non_forward_share", "cpu_ms_per_token", "tokens_per_cpu_s")
    medians = {v: {k: statistics.median(r[v][k] for r in repeats)
                   for k in keys if all(r[v].get(k) is not None for r in repeats)} for v in variants}
    hf_names = [v for v in variants if v.startswith("hf")]
    # ratios repeat by repeat, against the best transformers variant of the same repeat
    thr = [r["engine-adaserve"]["throughput_tok_s"] / max(r[h]["throughput_tok_s"] for h in hf_names)
           for r in repeats]
    tpot = [r["engine-adaserve"]["mean_tpot_ms"] / min(r[h]["mean_tpot_ms"] for h in hf_names) for r in repeats]
    best_engine_thr = [max(r[e]["throughput_tok_s"] for e in ENGINE_POLICIES) /
                       max(r[h]["throughput_tok_s"] for h in hf_names) for r in repeats]
    cpu_tok = [r["engine-adaserve"]["cpu_ms_per_token"] / min(r[h]["cpu_ms_per_token"] for h in hf_names)
               for r in repeats]
    cpu_thr = [r["engine-adaserve"]["tokens_per_cpu_s"] / max(r[h]["tokens_per_cpu_s"] for h in hf_names)
               for r in repeats]
    return {"variants": variants, "median": medians, "repeats": repeats,
            "engine_adaserve_over_best_hf": {"throughput": ratio_stats(thr), "tpot": ratio_stats(tpot),
                                             "cpu_ms_per_token": ratio_stats(cpu_tok),
                                             "tokens_per_cpu_s": ratio_stats(cpu_thr)},
            "best_engine_over_best_hf_throughput": ratio_stats(best_engine_thr)}


def run_peer(target: ModelRunner, draft: ModelRunner, hf: HFPeer, tokenizer: Any, cfg: PeerConfig, *,
             progress: bool = False) -> dict[str, Any]:
    ids = prompts(tokenizer, max(cfg.concurrency, 1), cfg.prompt_tokens)
    rng = np.random.default_rng(cfg.seed)
    caps = rng.integers(cfg.min_tokens, cfg.max_tokens, cfg.concurrency, endpoint=True).tolist()
    offsets = ([0.0] * cfg.concurrency if cfg.arrival_rate is None
               else np.cumsum(rng.exponential(1.0 / cfg.arrival_rate, cfg.concurrency)).tolist())
    single = scenario_arrivals(ids[:1], [cfg.max_tokens], [0.0])
    concurrent = scenario_arrivals(ids[: cfg.concurrency], caps, offsets)
    warm = scenario_arrivals(ids[:2], [4, 4], [0.0, 0.0])
    for v in [*ENGINE_POLICIES, *HF_VARIANTS]:  # first calls allocate and initialise: not timed
        run_variant(v, warm, target, draft, hf, cfg.budget)
    engines = list(ENGINE_POLICIES)
    return {
        # where the time goes: a forward over m tokens against one token, target and draft
        "forward_cpu_ms_by_tokens": {"target": forward_costs(target), "draft": forward_costs(draft),
                                 **plain_linear_costs(target, draft)},
        "single": run_scenario("single", [*engines, *HF_VARIANTS], single, target, draft, hf, cfg,
                               progress=progress),
        "concurrent": {"caps": caps, "arrivals_s": offsets,
                       **run_scenario("concurrent", [*engines, "hf", "hf-static"], concurrent, target, draft, hf,
                                      cfg, progress=progress)},
    }


def forward_costs(runner: ModelRunner, *, context: int = 200, sizes: tuple[int, ...] = (1, 2, 3, 5, 9, 17),
                  repeats: int = 7) -> dict[str, float]:
    """CPU milliseconds of one forward over a tree of m new tokens (binary, m = 1 is plain decoding) after
    ``context`` cached tokens, the minimum of ``repeats``: what a verification costs against one token.
    CPU time, not wall time: with one torch thread it is the forward's own cost, whatever else runs."""
    seq = SequenceKV()
    runner.forward([Segment(seq, 0, TokenTree.chain(list(range(100, 100 + context))))], all_logits=[False])
    runner.cache.truncate(seq, context)
    out = {}
    for m in sizes:
        tree = TokenTree.from_lists(list(range(5, 5 + m)), [-1] + [(i - 1) // 2 for i in range(1, m)])
        times = []
        for _ in range(repeats):
            t0 = time.process_time()
            runner.forward([Segment(seq, context, tree)], all_logits=[True])
            times.append(time.process_time() - t0)
            runner.cache.truncate(seq, context)
        out[str(m)] = 1e3 * min(times)
    runner.cache.release(seq)
    return out


def plain_linear_costs(target: ModelRunner, draft: ModelRunner) -> dict[str, dict[str, float]]:
    """The same forwards with F.linear everywhere (what the few-row kernels save, engine/model/few_rows.py)."""
    out = {}
    for name, r in (("target", target), ("draft", draft)):
        with plain_linear(r.model):
            out[f"{name}_plain_linear"] = forward_costs(r)
    return out


def verdict(report: dict[str, Any]) -> dict[str, Any]:
    """The issue's two targets, read from the medians of the per-repeat ratios."""
    single = report["single"]["engine_adaserve_over_best_hf"]
    conc = report["concurrent"]["engine_adaserve_over_best_hf"]
    out = {"single_tpot_engine_over_hf": single["tpot"]["median"],
           "single_cpu_per_token_engine_over_hf": single["cpu_ms_per_token"]["median"],
           "concurrent_throughput_engine_over_hf": conc["throughput"]["median"],
           "concurrent_tokens_per_cpu_s_engine_over_hf": conc["tokens_per_cpu_s"]["median"]}
    return {**out, "single_no_worse": out["single_tpot_engine_over_hf"] <= 1.0,
            "single_no_worse_in_cpu_time": out["single_cpu_per_token_engine_over_hf"] <= 1.0,
            "concurrent_at_least_3x": out["concurrent_throughput_engine_over_hf"] >= 3.0,
            "concurrent_at_least_3x_in_cpu_time": out["concurrent_tokens_per_cpu_s_engine_over_hf"] >= 3.0}


def run_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """Raises ValueError for bad settings (the CLI turns it into a one-line error)."""
    cfg = peer_config(args)
    set_threads(args.threads)
    target, draft, tok = load_pair(args.model, args.device, cfg.kv_memory_mb)
    pair = resolve(args.model, progress=False)
    eos = target.model.cfg.eos_token_ids
    pad = tok.pad_token_id if tok.pad_token_id is not None else (eos[0] if eos else 0)
    hf = HFPeer(pair.target, pair.draft, eos_token_id=eos[0] if eos else None, pad_token_id=pad,
                device=target.device, dtype=target.dtype)
    results = run_peer(target, draft, hf, tok, cfg, progress=True)
    report = {"benchmark": "hf-peer",
              "config": {**settings(target, cfg, model=args.model, device=args.device),
                         "hf_dtype": str(hf.model.dtype).removeprefix("torch."), "hf_device": str(hf.model.device),
                         "sampling": "greedy, EOS ends",
                         "transformers": _transformers_version()},
              **results}
    report["verdict"] = verdict(report)
    write_report(report, args.json)
    return report


def _transformers_version() -> str:
    import transformers

    return str(transformers.__version__)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m adaserve.bench.peer_compare", description=__doc__.splitlines()[0])
    add_common(p)
    add_engine_only(p)  # --repeats, --prompt-tokens, --budget
    add_peer(p)
    try:
        run_from_args(p.parse_args(argv))
    except ValueError as e:
        print(f"peer_compare: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
