"""Multi-turn chat with and without prefix caching: each turn's TTFT on the wall clock (issue 34).

    for each repeat r, and each mode in (cached, uncached), alternating which runs first:
        a fresh engine over the same loaded models (EngineConfig.prefix_caching on or off; the cache starts cold)
        serves the conversations of ``workload.build_conversations``: turn 1 when a conversation starts, turn
        k+1 ``think_s`` after turn k's answer, its prompt the chat template over the system prompt, every
        earlier turn and answer, and the new user turn
        per turn: TTFT (engine arrival -> first token), prompt tokens, tokens served from the prefix cache

Greedy and ``ignore_eos``: the answers, and so every later prompt, are the same in both modes (prefix caching
is lossless; the report's ``same_outputs`` checks it). The headline is the ratio of the median later-turn
TTFT without caching to with it, per repeat (both modes of a repeat run back to back on the same machine),
with the spread over repeats.

    python -m adaserve.bench.prefix_reuse --json docs/results/prefix-reuse-cpu-smollm2.json
"""

from __future__ import annotations

import argparse
import heapq
import json
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch

from adaserve.bench.workload import (
    Conversation,
    MultiTurnConfig,
    build_conversations,
    conversation_turns,
    system_prompt,
)
from adaserve.engine.config import EngineConfig
from adaserve.engine.engine import Engine
from adaserve.engine.loading.chat import chat_text, has_chat_template
from adaserve.engine.model.kv_cache import KVCacheConfig
from adaserve.engine.model.runner import ModelRunner
from adaserve.engine.request import Request
from adaserve.engine.speculation.sampling import SamplingParams

DEFAULT_MODEL = "smollm2-135m-instruct"
MODES = ("cached", "uncached")


@dataclass(frozen=True)
class Turn:
    conversation_id: str
    turn: int  # 1-based
    prompt_tokens: int
    cached_tokens: int
    ttft_ms: float
    tpot_ms: float | None
    output_ids: tuple[int, ...]


def prompt_ids(tokenizer: Any, msgs: list[dict[str, str]]) -> list[int]:
    """The turn's prompt as the worker renders ``messages``: the model's chat template, its generation prompt
    opened (a base model: a plain transcript)."""
    return list(tokenizer.encode(chat_text(tokenizer, msgs), add_special_tokens=not has_chat_template(tokenizer)))


def serve_conversations(
    eng: Engine, tokenizer: Any, system: str, convs: list[Conversation], *, think_s: float
) -> list[Turn]:
    """Every turn of ``convs`` on ``eng``'s wall clock, each turn arriving when its user would send it."""
    start = time.perf_counter()
    due: list[tuple[float, int]] = [(c.start_s, i) for i, c in enumerate(convs)]  # (time, conversation)
    heapq.heapify(due)
    answers: list[list[str]] = [[] for _ in convs]
    live: dict[str, tuple[int, Request]] = {}
    out: list[Turn] = []
    while due or eng.has_work:
        now = time.perf_counter() - start
        while due and due[0][0] <= now:
            _, i = heapq.heappop(due)
            c, k = convs[i], len(answers[i])
            ids = prompt_ids(tokenizer, conversation_turns(system, c.user_turns, answers[i]))
            req = Request(
                f"{c.conversation_id}-t{k + 1}", ids, SamplingParams(max_tokens=c.max_tokens[k], ignore_eos=True)
            )
            eng.add_request(req)
            live[req.request_id] = (i, req)
        if not eng.has_work:
            time.sleep(max(0.0, min(due[0][0] - now, 0.05)))
            continue
        for ev in eng.step():
            if not ev.finished:
                continue
            i, req = live.pop(ev.request_id)
            answers[i].append(tokenizer.decode(req.output_ids, skip_special_tokens=True))
            m = req.metrics
            out.append(
                Turn(
                    convs[i].conversation_id,
                    len(answers[i]),
                    len(req.prompt_ids),
                    m.cached_tokens,
                    float(m.ttft_ms or 0.0),
                    m.tpot_ms,
                    tuple(req.output_ids),
                )
            )
            if len(answers[i]) < len(convs[i].user_turns):
                heapq.heappush(due, (time.perf_counter() - start + think_s, i))
    return sorted(out, key=lambda t: (t.conversation_id, t.turn))


def summary(turns: list[Turn]) -> dict[str, Any]:
    """Per turn number: count, median and mean TTFT, mean prompt and cached tokens."""
    by: dict[int, list[Turn]] = {}
    for t in turns:
        by.setdefault(t.turn, []).append(t)
    return {
        str(k): {
            "n": len(ts),
            "ttft_ms_median": statistics.median(t.ttft_ms for t in ts),
            "ttft_ms_mean": statistics.fmean(t.ttft_ms for t in ts),
            "prompt_tokens_mean": statistics.fmean(t.prompt_tokens for t in ts),
            "cached_tokens_mean": statistics.fmean(t.cached_tokens for t in ts),
        }
        for k, ts in sorted(by.items())
    }


def later_median(turns: list[Turn]) -> float:
    """Median TTFT of every turn after the first (the turns a conversation's history can be cached for)."""
    return statistics.median(t.ttft_ms for t in turns if t.turn > 1)


def spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def run(
    target: ModelRunner,
    draft: ModelRunner,
    tokenizer: Any,
    cfg: MultiTurnConfig,
    *,
    policy: str,
    budget: int,
    repeats: int,
    progress: bool = True,
) -> dict[str, Any]:
    system = system_prompt(cfg.system_chars)
    convs = build_conversations(cfg)
    base = EngineConfig(policy=policy, budget=budget)
    # untimed: the first forwards of each shape (and, once per machine, the few-row kernels' calibration)
    warm = Engine(target, draft, replace(base, prefix_caching=False))
    serve_conversations(warm, tokenizer, system, [replace(convs[0], start_s=0.0)], think_s=0.0)
    runs: list[dict[str, Any]] = []
    for r in range(repeats):
        order = MODES if r % 2 == 0 else MODES[::-1]
        turns: dict[str, list[Turn]] = {}
        for mode in order:
            eng = Engine(target, draft, replace(base, prefix_caching=mode == "cached"))
            turns[mode] = serve_conversations(eng, tokenizer, system, convs, think_s=cfg.think_s)
            if progress:
                print(
                    f"repeat {r + 1}/{repeats} {mode}: later-turn TTFT median {later_median(turns[mode]):.1f} ms",
                    file=sys.stderr,
                    flush=True,
                )
        same = all(a.output_ids == b.output_ids for a, b in zip(turns["cached"], turns["uncached"], strict=True))
        runs.append(
            {
                "order": list(order),
                "same_outputs": same,
                "later_turn_ttft_ratio": later_median(turns["uncached"]) / later_median(turns["cached"]),
                **{
                    mode: {"later_turn_ttft_ms_median": later_median(ts), "by_turn": summary(ts)}
                    for mode, ts in turns.items()
                },
            }
        )
    ratios = [x["later_turn_ttft_ratio"] for x in runs]
    return {
        "later_turn_ttft_ratio": spread(ratios),
        "later_turn_ttft_ms": {m: spread([x[m]["later_turn_ttft_ms_median"] for x in runs]) for m in MODES},
        "same_outputs": all(x["same_outputs"] for x in runs),
        "system_prompt_tokens": len(prompt_ids(tokenizer, [{"role": "system", "content": system}])),
        "runs": runs,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m adaserve.bench.prefix_reuse", description=__doc__.splitlines()[0])
    p.add_argument("--model", default=DEFAULT_MODEL, help="a model that brings its draft (default %(default)s)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--policy", default="adaserve")
    p.add_argument("--budget", type=int, default=16, help="B, fixed (no profiling); default %(default)s")
    p.add_argument("--conversations", type=int, default=MultiTurnConfig.conversations)
    p.add_argument("--turns", type=int, default=MultiTurnConfig.turns)
    p.add_argument("--rate", type=float, default=MultiTurnConfig.rate, help="conversations started per second")
    p.add_argument("--think-s", type=float, default=MultiTurnConfig.think_s)
    p.add_argument("--max-tokens", type=int, default=MultiTurnConfig.max_tokens)
    p.add_argument("--system-chars", type=int, default=MultiTurnConfig.system_chars)
    p.add_argument("--trace", type=Path, help="Azure conversation trace: its timestamps start the conversations")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--kv-memory-mb", type=int, default=512)
    p.add_argument("--threads", type=int, help="torch CPU threads")
    p.add_argument("--json", type=Path, help="also write the report here")
    args = p.parse_args(argv)
    try:
        cfg = MultiTurnConfig(
            conversations=args.conversations,
            turns=args.turns,
            rate=args.rate,
            think_s=args.think_s,
            max_tokens=args.max_tokens,
            system_chars=args.system_chars,
            trace=args.trace,
            seed=args.seed,
        )
        if args.repeats < 1 or args.budget < 1:
            raise ValueError("--repeats and --budget must be >= 1")
        if args.turns < 2:
            raise ValueError("--turns must be >= 2: the first turn has no history to reuse")
    except ValueError as e:
        print(f"prefix_reuse: error: {e}", file=sys.stderr)
        return 2
    from adaserve.engine.build import resolve_device
    from adaserve.engine.loading.catalog import resolve
    from adaserve.engine.loading.loader import load_model, load_tokenizer

    if args.threads:
        torch.set_num_threads(args.threads)
    pair = resolve(args.model, progress=False)
    if pair.draft is None:
        print(f"prefix_reuse: error: {args.model} brings no draft", file=sys.stderr)
        return 2
    dev = resolve_device(args.device)
    rc = EngineConfig(kv=KVCacheConfig(memory_bytes=args.kv_memory_mb * 2**20))
    target = ModelRunner(load_model(pair.target, device=dev, progress=False), rc)
    draft = ModelRunner(load_model(pair.draft, device=dev, progress=False), rc)
    report = {
        "benchmark": "prefix-reuse",
        "config": {
            "model": args.model,
            "device": args.device,
            "policy": args.policy,
            "budget": args.budget,
            "repeats": args.repeats,
            "workload": {k: str(v) if isinstance(v, Path) else v for k, v in asdict(cfg).items()},
            "threads": torch.get_num_threads(),
            "machine": platform.machine(),
            "sampling": "greedy, ignore_eos",
        },
        **run(
            target,
            draft,
            load_tokenizer(pair.target),
            cfg,
            policy=args.policy,
            budget=args.budget,
            repeats=args.repeats,
        ),
    }
    text = json.dumps(report, indent=2)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
