"""Load through the gateway: SLO attainment per class against request rate, seen by the client.

``adaserve bench`` drives the engine in-process; this drives a running gateway over HTTP the way
applications do (streaming ``/v1/chat/completions`` naming an ``X-SLO-Class``), so it measures what users
get: engine, worker, gateway, admission and shedding together. It works against ``adaserve up`` or a
cluster's gateway alike.

Per request, from the client's clock::

    ttft = t(first chunk with text) - t(send)
    tpot = (t(last chunk with text) - t(first chunk with text)) / (completion_tokens - 1)

(the stream's final usage chunk gives ``completion_tokens``; a speculative step can put several tokens
in one chunk, so chunks are not counted). A request meets its SLO when ``tpot <= tpot_ms`` of its class
(AdaServe section 6.1); a refused request (429/503) or one that failed counts as a miss, and the
report also counts them separately. The arrival schedule and prompts are those of ``adaserve bench``
(bench/workload.py), with the targets the gateway publishes at ``/v1/slo-classes``.

Gateway overhead: the same greedy requests one at a time, straight to the worker and through the
gateway, alternating; the medians' differences are what the gateway adds to TTFT and to each token.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from adaserve.bench.metrics import REFUSED, RequestResult, summarize
from adaserve.bench.workload import PROMPT_SOURCES, SLOClass, WorkloadConfig, WorkloadRequest, build_workload

OVERHEAD_PROMPT = "def quicksort(items):"


@dataclass(frozen=True)
class LoadConfig:
    url: str
    model: str
    rates: tuple[float, ...]
    duration_s: float = 30.0
    mix: dict[str, float] | None = None  # default: equal shares of the gateway's classes that have prompts
    seed: int = 0
    max_tokens_cap: int = 128
    api_key: str | None = None
    timeout_s: float = 300.0

    def __post_init__(self) -> None:
        if not self.rates or any(not (r > 0) for r in self.rates):
            raise ValueError(f"rates must be positive, got {self.rates}")
        if not self.duration_s > 0:
            raise ValueError(f"duration must be positive, got {self.duration_s}")

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


@dataclass(frozen=True)
class Timing:
    """When a streamed answer arrived, on the client's clock (seconds)."""

    sent: float
    first: float | None  # first chunk that carried text
    last: float | None
    tokens: int

    def ttft_ms(self) -> float | None:
        return None if self.first is None else 1000 * (self.first - self.sent)

    def tpot_ms(self) -> float | None:
        if self.first is None or self.last is None or self.tokens < 2:
            return None
        return 1000 * (self.last - self.first) / (self.tokens - 1)


def classes_from(published: dict[str, Any]) -> tuple[SLOClass, ...]:
    """The gateway's ``/v1/slo-classes`` answer as workload classes (absolute targets)."""
    return tuple(SLOClass(c["name"], tpot_multiplier=None, tpot_ms=float(c["tpot_ms"]), share=0.0)
                 for c in published["data"])


def default_mix(classes: Sequence[SLOClass]) -> dict[str, float]:
    """Equal shares of the classes this benchmark has prompts for."""
    names = [c.name for c in classes if c.name in PROMPT_SOURCES]
    if not names:
        raise ValueError(f"none of the gateway's classes {[c.name for c in classes]} has a prompt source "
                         f"here ({sorted(PROMPT_SOURCES)}); give --mix with those names")
    return {n: 1 / len(names) for n in names}


async def sse_data(resp: httpx.Response) -> AsyncIterator[dict[str, Any]]:
    """The JSON payloads of a server-sent event stream, up to ``[DONE]``."""
    async for line in resp.aiter_lines():
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            return
        yield json.loads(data)


async def stream_completion(client: httpx.AsyncClient, cfg: LoadConfig, req: WorkloadRequest) -> tuple[Timing, str]:
    """One streamed chat completion through the gateway (the prompt as one user turn, rendered with the
    model's chat template, as ``adaserve bench`` sends it): when its text arrived, and how it finished."""
    body = {"model": cfg.model, "messages": [{"role": "user", "content": req.prompt}], "max_tokens": req.max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    headers = {**cfg.headers(), "X-SLO-Class": req.slo_class}
    sent, first, last, tokens, finish = time.perf_counter(), None, None, 0, "error"
    try:
        async with client.stream("POST", f"{cfg.url}/v1/chat/completions", json=body, headers=headers) as resp:
            if resp.status_code in (429, 503):
                finish = REFUSED
            elif resp.status_code == 200:
                async for chunk in sse_data(resp):
                    now = time.perf_counter()
                    if "error" in chunk:
                        finish = "error"
                        break
                    for choice in chunk.get("choices") or []:
                        if (choice.get("delta") or {}).get("content"):
                            first = first if first is not None else now
                            last = now
                        finish = choice.get("finish_reason") or finish
                    if chunk.get("usage"):
                        tokens = int(chunk["usage"]["completion_tokens"])
    except httpx.HTTPError:
        finish = "error"
    return Timing(sent, first, last, tokens), finish


async def complete(client: httpx.AsyncClient, cfg: LoadConfig, req: WorkloadRequest) -> RequestResult:
    """One request of the workload, as the bench's metrics count it."""
    timing, finish = await stream_completion(client, cfg, req)
    return RequestResult(request_id=req.request_id, slo_class=req.slo_class, tpot_slo_ms=req.tpot_slo_ms,
                         tokens=timing.tokens, tpot_ms=timing.tpot_ms(), ttft_ms=timing.ttft_ms(),
                         accepted_per_step=(), finish_reason=finish)


async def run_rate(cfg: LoadConfig, workload: Sequence[WorkloadRequest],
                   on_done: Callable[[], None] = lambda: None) -> tuple[list[RequestResult], float]:
    """Send every request at its arrival time (open loop: a slow answer does not delay the next send)."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    async with httpx.AsyncClient(timeout=cfg.timeout_s, limits=limits) as client:
        start = time.perf_counter()

        async def at(req: WorkloadRequest) -> RequestResult:
            await asyncio.sleep(max(0.0, start + req.arrival_s - time.perf_counter()))
            result = await complete(client, cfg, req)
            on_done()
            return result

        results = await asyncio.gather(*(at(r) for r in workload))
        return list(results), time.perf_counter() - start


def rate_report(rate: float, results: Sequence[RequestResult], wall_s: float) -> dict[str, Any]:
    summary = summarize(results, wall_s=wall_s)
    for key in ("mean_accepted_per_verification", "scheduler_time_share"):  # engine-side figures
        summary.pop(key)
    summary["refused"] = sum(r.finish_reason == REFUSED for r in results)
    summary["failed"] = sum(r.finish_reason in (None, "error") for r in results)
    for name, row in summary["per_class"].items():
        rs = [r for r in results if r.slo_class == name]
        row["refused"] = sum(r.finish_reason == REFUSED for r in rs)
        ttfts = sorted(r.ttft_ms for r in rs if r.ttft_ms is not None)
        row["p50_ttft_ms"] = statistics.median(ttfts) if ttfts else None
    return {"rate_rps": rate, **summary}


def build(cfg: LoadConfig, classes: tuple[SLOClass, ...], rate: float) -> list[WorkloadRequest]:
    mix = cfg.mix or default_mix(classes)
    wl = WorkloadConfig(rate, cfg.duration_s, baseline_tpot_ms=1.0, seed=cfg.seed, mix=mix,
                        classes=tuple(c for c in classes if c.name in mix), max_tokens_cap=cfg.max_tokens_cap)
    return build_workload(wl)


async def fetch_json(client: httpx.AsyncClient, url: str, headers: dict[str, str]) -> dict[str, Any]:
    r = await client.get(url, headers=headers)
    if r.status_code != 200:
        raise ValueError(f"GET {url} answered {r.status_code}: {r.text[:200]}")
    return dict(r.json())


# --- gateway overhead -----------------------------------------------------------------------------------

async def _direct(client: httpx.AsyncClient, worker_url: str, max_tokens: int) -> Timing:
    body = {"prompt": OVERHEAD_PROMPT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "slo_class": "chat"}
    sent, first, last, tokens = time.perf_counter(), None, None, 0
    async with client.stream("POST", f"{worker_url}/v1/generate", json=body) as resp:
        resp.raise_for_status()
        async for chunk in sse_data(resp):
            now = time.perf_counter()
            if chunk.get("token_ids"):
                first = first if first is not None else now
                last = now
                tokens += len(chunk["token_ids"])
    return Timing(sent, first, last, tokens)


async def _via_gateway(client: httpx.AsyncClient, cfg: LoadConfig, max_tokens: int) -> Timing:
    req = WorkloadRequest("overhead", 0.0, "chat", OVERHEAD_PROMPT, max_tokens, 1e9)
    timing, finish = await stream_completion(client, cfg, req)
    if timing.tpot_ms() is None:
        raise ValueError(f"the gateway did not stream an answer (finish_reason {finish!r})")
    return timing


def overhead_report(direct: Sequence[Timing], gateway: Sequence[Timing]) -> dict[str, Any]:
    """Medians of each path and their differences (what the gateway adds)."""

    def med(ts: Sequence[Timing], f: Callable[[Timing], float | None]) -> float:
        return statistics.median(v for v in map(f, ts) if v is not None)

    out: dict[str, Any] = {"requests_each": len(direct)}
    for name, fn in (("ttft_ms", Timing.ttft_ms), ("tpot_ms", Timing.tpot_ms)):
        d, g = med(direct, fn), med(gateway, fn)
        out[name] = {"direct": round(d, 3), "gateway": round(g, 3), "added": round(g - d, 3)}
    return out


async def measure_overhead(cfg: LoadConfig, worker_url: str, *, requests: int = 8,
                           max_tokens: int = 64) -> dict[str, Any]:
    direct: list[Timing] = []
    gateway: list[Timing] = []
    async with httpx.AsyncClient(timeout=cfg.timeout_s) as client:
        await _direct(client, worker_url, max_tokens)  # warm both paths once
        await _via_gateway(client, cfg, max_tokens)
        for _ in range(requests):
            direct.append(await _direct(client, worker_url, max_tokens))
            gateway.append(await _via_gateway(client, cfg, max_tokens))
    return overhead_report(direct, gateway)


def plot_load(report: dict[str, Any], path: Path) -> None:
    """SLO attainment and mean TPOT per class against request rate."""
    from adaserve.plots import panels

    with panels(path, 2) as (fig, (ax1, ax2)):
        _draw_load(report, fig, ax1, ax2)


def _draw_load(report: dict[str, Any], fig: Any, ax1: Any, ax2: Any) -> None:
    rows = report["rates"]
    rates = [r["rate_rps"] for r in rows]
    ax1.plot(rates, [100 * r["slo_attainment"] for r in rows], "ko-", linewidth=2.5, label="all")
    for c in report["classes"]:
        name = c["name"]
        got = [r["per_class"].get(name) for r in rows]
        if not any(got):
            continue
        xs = [x for x, g in zip(rates, got, strict=True) if g]
        line, = ax1.plot(xs, [100 * g["slo_attainment"] for g in got if g], "o-", label=f"{name} ({c['tpot_ms']:g} ms)")
        ax2.plot(xs, [g["mean_tpot_ms"] or float("nan") for g in got if g], "o-", color=line.get_color(), label=name)
        ax2.axhline(c["tpot_ms"], color=line.get_color(), linestyle="--", linewidth=1)
    ax1.set(xlabel="request rate (req/s)", ylabel="SLO attainment (%)", ylim=(0, 105),
            title="SLO attainment through the gateway")
    ax2.set(xlabel="request rate (req/s)", ylabel="mean TPOT (ms), dashed = target", title="Per-token latency")
    ax1.legend(fontsize=8)
    fig.suptitle(f"model {report['model']} at {report['url']}", fontsize=9)
