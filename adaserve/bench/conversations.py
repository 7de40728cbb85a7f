"""Multi-turn conversations through the gateway: does each turn go back to the worker holding its history, and
what TTFT does it get (issue 34; ``adaserve loadtest --conversations N``)?

The conversations are those of ``adaserve.bench.prefix_reuse`` (bench/workload.py ``build_conversations``): one
shared system prompt, each conversation starting at its arrival time, its turn k+1 sent ``think_s`` after turn
k's answer ended, with every earlier user turn and answer repeated (``conversation_turns``). Each turn is a
streamed chat completion, greedy, EOS ignored, in the gateway's default class unless one is named. Per turn
the client records the worker that served it (the gateway's ``X-Adaserve-Worker`` header), its TTFT on the
client's clock, and how it ended.

The report:

- ``affinity``: of the later turns (2, 3, ...) whose turn before was served, the share served by the same
  worker as that turn: the one holding the conversation's history in its prefix cache. With two workers and no
  affinity at all, about a half.
- ``ttft_ms`` per turn number: median and 90th percentile, over the turns served.
- ``workers``: turns served by each worker.
- ``gateway_prefix``: the gateway's prefix-affinity counters over the run (``adaserve_gateway_prefix_*``,
  docs/gateway.md), its routing's hit rate in requests and in blocks.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import httpx

from adaserve.bench.loadgen import LoadConfig, fetch_text, sse_data
from adaserve.bench.metrics import REFUSED
from adaserve.bench.workload import (
    Conversation,
    MultiTurnConfig,
    build_conversations,
    conversation_turns,
    system_prompt,
)


@dataclass(frozen=True)
class TurnResult:
    conversation_id: str
    turn: int  # 1-based
    worker: str | None  # who served it (None: refused or failed before an answer started)
    ttft_ms: float | None
    tokens: int
    finish: str  # stop | length | refused | error
    prompt_chars: int  # the messages' content, all turns so far


async def one_turn(client: httpx.AsyncClient, cfg: LoadConfig, messages: list[dict[str, str]], max_tokens: int,
                   slo_class: str | None) -> tuple[TurnResult, str]:
    """One streamed chat turn through the gateway: its result (ids left blank) and its answer's text."""
    body = {"model": cfg.model, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    headers = {**cfg.headers(), **({"X-SLO-Class": slo_class} if slo_class else {})}
    sent, first, tokens, finish, worker, parts = time.perf_counter(), None, 0, "error", None, []
    try:
        async with client.stream("POST", f"{cfg.url}/v1/chat/completions", json=body, headers=headers) as resp:
            if resp.status_code in (429, 503):
                finish = REFUSED
            elif resp.status_code == 200:
                worker = resp.headers.get("X-Adaserve-Worker")
                async for chunk in sse_data(resp):
                    if "error" in chunk:
                        finish = "error"
                        break
                    for choice in chunk.get("choices") or []:
                        text = (choice.get("delta") or {}).get("content")
                        if text:
                            first = first if first is not None else time.perf_counter()
                            parts.append(text)
                        finish = choice.get("finish_reason") or finish
                    if chunk.get("usage"):
                        tokens = int(chunk["usage"]["completion_tokens"])
    except httpx.HTTPError:
        finish = "error"
    ttft = None if first is None else 1000 * (first - sent)
    chars = sum(len(m["content"]) for m in messages)
    return TurnResult("", 0, worker if finish not in (REFUSED, "error") else None, ttft, tokens, finish,
                      chars), "".join(parts)


async def run_conversations(cfg: LoadConfig, mt: MultiTurnConfig, *, slo_class: str | None = None,
                            on_turn: Callable[[], None] = lambda: None) -> list[TurnResult]:
    """Every conversation of ``mt`` from its start time, turn after turn; a conversation whose turn was refused
    or failed ends there (its later turns would repeat an answer it never got)."""
    system = system_prompt(mt.system_chars)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    async with httpx.AsyncClient(timeout=cfg.timeout_s, limits=limits) as client:
        start = time.perf_counter()

        async def talk(conv: Conversation) -> list[TurnResult]:
            await asyncio.sleep(max(0.0, start + conv.start_s - time.perf_counter()))
            answers: list[str] = []
            out: list[TurnResult] = []
            for k, max_tokens in enumerate(conv.max_tokens, start=1):
                messages = conversation_turns(system, conv.user_turns, answers)
                result, text = await one_turn(client, cfg, messages, max_tokens, slo_class)
                out.append(TurnResult(**{**asdict(result), "conversation_id": conv.conversation_id, "turn": k}))
                on_turn()
                if result.worker is None:
                    break
                answers.append(text)
                if k < len(conv.max_tokens):
                    await asyncio.sleep(mt.think_s)
            return out

        done = await asyncio.gather(*(talk(c) for c in build_conversations(mt)))
    return [t for turns in done for t in turns]


def _quantile(xs: Sequence[float], q: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))]


def affinity_report(turns: Sequence[TurnResult]) -> dict[str, Any]:
    """Affinity (later turns on their previous turn's worker), TTFT per turn number, turns per worker."""
    by_conv: dict[str, dict[int, TurnResult]] = {}
    for t in turns:
        by_conv.setdefault(t.conversation_id, {})[t.turn] = t
    followed = later = 0
    for conv in by_conv.values():
        for k, t in conv.items():
            before = conv.get(k - 1)
            if k > 1 and t.worker is not None and before is not None and before.worker is not None:
                later += 1
                followed += t.worker == before.worker
    ttft: dict[str, dict[str, Any]] = {}
    for k in sorted({t.turn for t in turns}):
        xs = [t.ttft_ms for t in turns if t.turn == k and t.ttft_ms is not None]
        ttft[str(k)] = {"served": len(xs), "median": statistics.median(xs) if xs else None,
                        "p90": _quantile(xs, 0.9)}
    return {"affinity": followed / later if later else None, "later_turns": later, "followed": followed,
            "ttft_ms": ttft, "workers": dict(Counter(t.worker for t in turns if t.worker is not None)),
            "unserved": dict(Counter(t.finish for t in turns if t.worker is None))}


def prefix_counters(metrics_text: str) -> dict[str, float]:
    """The gateway's prefix-affinity counters, from its /metrics text: ``requests_<result>``, ``routed`` and
    ``blocks_<what>``."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for family in text_string_to_metric_families(metrics_text):
        for s in family.samples:
            if not s.name.endswith("_total"):
                continue
            if family.name == "adaserve_gateway_prefix_requests":
                out[f"requests_{s.labels['result']}"] = s.value
            elif family.name == "adaserve_gateway_prefix_routed":
                out["routed"] = s.value
            elif family.name == "adaserve_gateway_prefix_blocks":
                out[f"blocks_{s.labels['what']}"] = s.value
    return out


def prefix_between(before: str, after: str) -> dict[str, Any]:
    """The prefix counters' growth between two scrapes, with the hit rates they give (all 0 and None with
    prefix affinity off; empty for a gateway without the counters)."""
    was, now = prefix_counters(before), prefix_counters(after)
    if not now:
        return {}
    d = {k: round(v - was.get(k, 0.0)) for k, v in sorted(now.items())}
    asked = d.get("requests_hit", 0) + d.get("requests_miss", 0) + d.get("requests_no_headroom", 0)
    sent = d.get("blocks_sent", 0)
    return {**d, "hit_rate_requests": d.get("requests_hit", 0) / asked if asked else None,
            "hit_rate_blocks": d.get("blocks_matched", 0) / sent if sent else None}


async def measure_conversations(cfg: LoadConfig, mt: MultiTurnConfig, *, slo_class: str | None = None,
                                on_turn: Callable[[], None] = lambda: None) -> dict[str, Any]:
    """One multi-turn run through ``cfg.url``: its config, the report above and every turn."""
    before = await fetch_text(cfg, "/metrics")
    started = time.perf_counter()
    turns = await run_conversations(cfg, mt, slo_class=slo_class, on_turn=on_turn)
    wall = time.perf_counter() - started
    after = await fetch_text(cfg, "/metrics")
    config = {**asdict(mt), "trace": str(mt.trace) if mt.trace else None, "slo_class": slo_class}
    return {"config": config, "wall_s": wall, **affinity_report(turns),
            "gateway_prefix": prefix_between(before, after), "turns": [asdict(t) for t in turns]}
