"""Load through the gateway: SLO attainment per class against request rate, seen by the client.

``adaserve bench`` drives the engine in-process; this drives a running gateway over HTTP the way
applications do (streaming ``/v1/chat/completions`` naming an ``X-SLO-Class``), so it measures what users
get: engine, worker, gateway, admission and shedding together. It works against ``adaserve up`` or a
cluster's gateway alike, and can run the same schedule through a second gateway (a plain load balancer,
``--routing least-loaded --admission none``) in the same run, rate by rate, alternating.

Per request, from the client's clock::

    ttft = t(first chunk with text) - t(send)
    tpot = (t(last chunk with text) - t(first chunk with text)) / (completion_tokens - 1)

(the stream's final usage chunk gives ``completion_tokens``; a speculative step can put several tokens
in one chunk, so chunks are not counted). A request meets its SLO by the one rule the worker and the
gateway use (adaserve/contract/slo.py ``slo_met``, handed in by the command, as the bench imports no service
package): it ended normally, its TPOT is within its class's target and, for a class with a TTFT target, so is
its TTFT. A refused request (429/503) or one that failed is a miss; the report
gives attainment over all requests and over the admitted ones, the refused share, goodput (output tokens of
requests that met their SLO, per second of the run) and TTFT, overall and per class. The arrival schedule and
prompts are those of ``adaserve bench`` (bench/workload.py), with the targets the gateway publishes at
``/v1/slo-classes``.

Capacity: the request rate the fleet can complete at all, ``throughput / mean output tokens per request``,
with the throughput measured by a closed loop of ``concurrency`` clients sending the workload's requests back
to back (``probe_capacity``). A sweep can then be given in multiples of it.

Gateway overhead: the same greedy requests one at a time, straight to the worker and through the
gateway, alternating; the medians' differences are what the gateway adds to TTFT and to each token.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import statistics
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import httpx

from adaserve.bench.metrics import REFUSED, RequestResult
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
    gateway_id: str | None = None  # the gateway's X-Request-Id, to read its record of the request

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
    sent, first, last, tokens, finish, gid = time.perf_counter(), None, None, 0, "error", None
    try:
        async with client.stream("POST", f"{cfg.url}/v1/chat/completions", json=body, headers=headers) as resp:
            gid = resp.headers.get("X-Request-Id")
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
    return Timing(sent, first, last, tokens, gid), finish


async def complete(client: httpx.AsyncClient, cfg: LoadConfig, req: WorkloadRequest,
                   ids: list[str] | None = None) -> RequestResult:
    """One request of the workload, as the bench's metrics count it; the gateway's id of it goes to ``ids``."""
    timing, finish = await stream_completion(client, cfg, req)
    if ids is not None and timing.gateway_id and finish != REFUSED:
        ids.append(timing.gateway_id)
    return RequestResult(request_id=req.request_id, slo_class=req.slo_class, tpot_slo_ms=req.tpot_slo_ms,
                         tokens=timing.tokens, tpot_ms=timing.tpot_ms(), ttft_ms=timing.ttft_ms(),
                         accepted_per_step=(), finish_reason=finish)


async def run_rate(cfg: LoadConfig, workload: Sequence[WorkloadRequest],
                   on_done: Callable[[], None] = lambda: None,
                   ids: list[str] | None = None) -> tuple[list[RequestResult], float]:
    """Send every request at its arrival time (open loop: a slow answer does not delay the next send); the
    gateway's ids of those it admitted go to ``ids``."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    async with httpx.AsyncClient(timeout=cfg.timeout_s, limits=limits) as client:
        start = time.perf_counter()

        async def at(req: WorkloadRequest) -> RequestResult:
            await asyncio.sleep(max(0.0, start + req.arrival_s - time.perf_counter()))
            result = await complete(client, cfg, req, ids)
            on_done()
            return result

        results = await asyncio.gather(*(at(r) for r in workload))
        return list(results), time.perf_counter() - start


class SloRule(Protocol):
    """adaserve/contract/slo.py ``slo_met``: whether a request that ended so met its targets."""

    def __call__(self, finish: str | None, *, tpot_ms: float | None, ttft_ms: float | None,
                 tpot_target_ms: float | None, ttft_target_ms: float | None = None) -> bool: ...


def met(r: RequestResult, ttft_target_ms: float | None, rule: SloRule) -> bool:
    """``rule`` on what the client saw; a refused request is a miss whatever the rule says."""
    return r.finish_reason != REFUSED and rule(r.finish_reason, tpot_ms=r.tpot_ms, ttft_ms=r.ttft_ms,
                                               tpot_target_ms=r.tpot_slo_ms, ttft_target_ms=ttft_target_ms)


def _mean(xs: Sequence[float]) -> float | None:
    return statistics.fmean(xs) if xs else None


def _quantile(xs: Sequence[float], q: float) -> float | None:
    if not xs:
        return None
    ordered = sorted(xs)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def summary(results: Sequence[RequestResult], wall_s: float, ttft_of: Callable[[str], float | None],
            rule: SloRule) -> dict[str, Any]:
    """Attainment of all and of admitted requests, refused share, goodput and latencies of ``results``."""
    n = len(results)
    admitted = [r for r in results if r.finish_reason != REFUSED]
    ok = [r for r in results if met(r, ttft_of(r.slo_class), rule)]
    ttfts = [r.ttft_ms for r in admitted if r.ttft_ms is not None]
    tpots = [r.tpot_ms for r in admitted if r.tpot_ms is not None]
    return {
        "requests": n,
        "admitted": len(admitted),
        "refused": n - len(admitted),
        "failed": sum(r.finish_reason in (None, "error", "abort") for r in results),
        "refused_share": (n - len(admitted)) / n if n else 0.0,
        "slo_attainment": len(ok) / n if n else 0.0,
        "admitted_attainment": len(ok) / len(admitted) if admitted else None,
        "goodput_tok_s": sum(r.tokens for r in ok) / wall_s,
        "throughput_tok_s": sum(r.tokens for r in admitted) / wall_s,
        "mean_tpot_ms": _mean(tpots),
        "p90_tpot_ms": _quantile(tpots, 0.9),
        "mean_ttft_ms": _mean(ttfts),
        "p50_ttft_ms": statistics.median(ttfts) if ttfts else None,
        "p90_ttft_ms": _quantile(ttfts, 0.9),
    }


def rate_report(rate: float, results: Sequence[RequestResult], wall_s: float, *, rule: SloRule,
                ttft_of: Callable[[str], float | None] = lambda _: None,
                capacity_rps: float | None = None) -> dict[str, Any]:
    """One rate: ``summary`` overall and per class; ``ttft_of``: each class's TTFT target (None: none)."""
    if wall_s <= 0:
        raise ValueError("wall_s must be positive")
    per_class = {}
    for name in sorted({r.slo_class for r in results}):
        rs = [r for r in results if r.slo_class == name]
        per_class[name] = {**summary(rs, wall_s, ttft_of, rule), "tpot_slo_ms": rs[0].tpot_slo_ms,
                           "ttft_slo_ms": ttft_of(name)}
    return {"rate_rps": rate, "load": rate / capacity_rps if capacity_rps else None,
            **summary(results, wall_s, ttft_of, rule), "wall_s": wall_s, "per_class": per_class}


def build(cfg: LoadConfig, classes: tuple[SLOClass, ...], rate: float) -> list[WorkloadRequest]:
    mix = cfg.mix or default_mix(classes)
    wl = WorkloadConfig(rate, cfg.duration_s, baseline_tpot_ms=1.0, seed=cfg.seed, mix=mix,
                        classes=tuple(c for c in classes if c.name in mix), max_tokens_cap=cfg.max_tokens_cap)
    return build_workload(wl)


async def fetch_records(cfg: LoadConfig, ids: Sequence[str]) -> list[dict[str, Any]]:
    """The gateway's records of these requests (``GET /v1/requests/{id}``), those it still has."""
    out = []
    async with httpx.AsyncClient(timeout=30) as client:
        for rid in ids:
            r = await client.get(f"{cfg.url}/v1/requests/{rid}", headers=cfg.headers())
            if r.status_code == 200:
                out.append(r.json())
    return out


def _num(x: Any) -> float | None:
    try:
        return float(x) if x not in (None, "") else None
    except (TypeError, ValueError):
        return None


def prediction_report(records: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """How well the gateway predicted the TPOT of its finished requests (its records): per class, the median of
    |log(predicted / observed)| before and after its learnt correction, and the requests themselves."""
    rows = []
    for rec in records:
        observed, raw, k = _num(rec.get("tpot_ms")), _num(rec.get("predicted_tpot_ms")), _num(rec.get("correction"))
        if rec.get("status") == "done" and observed and raw and k:
            rows.append({"slo_class": rec.get("slo_class"), "observed_ms": observed, "predicted_ms": raw,
                         "correction": k, "load": _num(rec.get("decoding_load")), "queued": rec.get("queued") == "1",
                         "admission": rec.get("admission")})

    def err(rs: Sequence[dict[str, Any]], corrected: bool) -> float | None:
        e = [abs(math.log(r["predicted_ms"] * (r["correction"] if corrected else 1.0) / r["observed_ms"])) for r in rs]
        return statistics.median(e) if e else None

    per_class = {}
    for name in sorted({r["slo_class"] for r in rows}):
        rs = [r for r in rows if r["slo_class"] == name]
        per_class[name] = {"requests": len(rs), "median_abs_log_error_raw": err(rs, False),
                           "median_abs_log_error_corrected": err(rs, True)}
    return {"requests": len(rows), "median_abs_log_error_raw": err(rows, False),
            "median_abs_log_error_corrected": err(rows, True), "per_class": per_class, "rows": rows}


def mean_tokens(cfg: LoadConfig, classes: tuple[SLOClass, ...], *, sample: int = 2000) -> float:
    """Mean output tokens per request of the workload's mix (its requests always run to max_tokens)."""
    reqs = build(dataclasses.replace(cfg, duration_s=sample / 10.0), classes, 10.0)
    return statistics.fmean(r.max_tokens for r in reqs)


async def probe_capacity(cfg: LoadConfig, classes: tuple[SLOClass, ...], *, url: str, concurrency: int,
                         duration_s: float) -> dict[str, Any]:
    """The fleet's throughput at ``url`` under a closed loop of ``concurrency`` clients sending the workload's
    requests back to back for ``duration_s`` (those in flight then are finished and counted), and the request
    rate it can complete at all: ``throughput / mean output tokens per request``."""
    if concurrency < 1 or not duration_s > 0:
        raise ValueError("the capacity probe needs concurrency >= 1 and a positive duration")
    probe = dataclasses.replace(cfg, url=url)
    queue = iter(build(dataclasses.replace(cfg, duration_s=max(60.0, 4 * duration_s)), classes, 10.0))
    done: list[RequestResult] = []
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    async with httpx.AsyncClient(timeout=cfg.timeout_s, limits=limits) as client:
        start = time.perf_counter()

        async def loop() -> None:
            for req in queue:
                if time.perf_counter() - start >= duration_s:
                    return
                done.append(await complete(client, probe, req))

        await asyncio.gather(*(loop() for _ in range(concurrency)))
        wall = time.perf_counter() - start
    tokens = sum(r.tokens for r in done if r.finish_reason != REFUSED)
    refused = sum(r.finish_reason == REFUSED for r in done)
    if not tokens:
        raise ValueError(f"the capacity probe at {url} got no tokens back ({refused} of {len(done)} refused)")
    per_request = mean_tokens(cfg, classes)
    return {"url": url, "concurrency": concurrency, "duration_s": duration_s, "wall_s": wall, "requests": len(done),
            "refused": refused, "throughput_tok_s": tokens / wall, "mean_tokens_per_request": per_request,
            "capacity_rps": tokens / wall / per_request}


# --- what the gateway thought during a rate: its class verdicts over time, and why it refused ---------------

async def watch_classes(cfg: LoadConfig, out: list[dict[str, Any]], *, every_s: float = 5.0) -> None:
    """Until cancelled: every ``every_s`` the gateway's verdict on each class (``/v1/slo-classes``: feasibility
    and the TPOT it predicts for a lone request), appended to ``out`` with seconds since the watch began. A
    class judged infeasible is served best effort: when and why a verdict flips is what these show."""
    start = time.perf_counter()
    async with httpx.AsyncClient(timeout=5) as client:
        while True:
            try:
                doc = await fetch_json(client, f"{cfg.url}/v1/slo-classes", cfg.headers())
                out.append({"t_s": round(time.perf_counter() - start, 1),
                            "classes": {c["name"]: [c.get("feasibility"), c.get("lone_tpot_ms")]
                                        for c in doc.get("data", [])}})
            except (httpx.HTTPError, ValueError):
                pass  # a missed look is only a gap in the timeline
            await asyncio.sleep(every_s)


def refusal_counts(metrics_text: str) -> dict[tuple[str, str], float]:
    """(class, reason) -> requests the gateway refused for lack of capacity, from its /metrics text."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[tuple[str, str], float] = {}
    for family in text_string_to_metric_families(metrics_text):
        if family.name == "adaserve_gateway_shed":
            for sample in family.samples:
                if sample.name.endswith("_total"):
                    out[(sample.labels["slo_class"], sample.labels["reason"])] = sample.value
    return out


def refusals_between(before: str, after: str) -> dict[str, dict[str, int]]:
    """Per class, per reason: the refusals counted between two /metrics scrapes."""
    was, now = refusal_counts(before), refusal_counts(after)
    out: dict[str, dict[str, int]] = {}
    for (name, reason), v in sorted(now.items()):
        if (d := round(v - was.get((name, reason), 0.0))) > 0:
            out.setdefault(name, {})[reason] = d
    return out


async def fetch_text(cfg: LoadConfig, path: str) -> str:
    async with httpx.AsyncClient(timeout=10) as client:
        r = await client.get(f"{cfg.url}{path}", headers=cfg.headers())
        return r.text if r.status_code == 200 else ""


async def fetch_json(client: httpx.AsyncClient, url: str, headers: dict[str, str]) -> dict[str, Any]:
    r = await client.get(url, headers=headers)
    if r.status_code != 200:
        raise ValueError(f"GET {url} answered {r.status_code}: {r.text[:200]}")
    return dict(r.json())


# --- an idle system: one request at a time, the gateway's view against the worker's ------------------------

async def _one_json(client: httpx.AsyncClient, cfg: LoadConfig, req: WorkloadRequest) -> dict[str, Any]:
    """One non-streamed chat completion and the gateway's record of it: TTFT and verdict at the gateway and at
    the worker, whether it queued."""
    body = {"model": cfg.model, "messages": [{"role": "user", "content": req.prompt}], "max_tokens": req.max_tokens,
            "temperature": 0, "ignore_eos": True}
    r = await client.post(f"{cfg.url}/v1/chat/completions", json=body,
                          headers={**cfg.headers(), "X-SLO-Class": req.slo_class})
    if r.status_code != 200:
        return {"slo_class": req.slo_class, "status": r.status_code, "refused": r.status_code in (429, 503)}
    answer = r.json()
    record = (await client.get(f"{cfg.url}/v1/requests/{answer['id']}", headers=cfg.headers())).json()
    info = answer.get("adaserve") or {}
    worker = info.get("metrics") or {}
    ttft = float(record["ttft_ms"]) if record.get("ttft_ms") else None
    return {"slo_class": req.slo_class, "status": 200, "refused": False, "tokens": answer["usage"]["completion_tokens"],
            "queued": record.get("queued") == "1", "gateway_ttft_ms": ttft, "worker_ttft_ms": worker.get("ttft_ms"),
            "gateway_tpot_ms": float(record["tpot_ms"]) if record.get("tpot_ms") else None,
            "worker_tpot_ms": worker.get("tpot_ms"), "gateway_slo_met": info.get("slo_met"),
            "worker_slo_met": info.get("worker_slo_met")}


def sequential_report(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Per class: refused, queued, the gateway's and the worker's attainment, what the gateway added to TTFT."""
    out: dict[str, Any] = {}
    for name in sorted({r["slo_class"] for r in rows}):
        rs = [r for r in rows if r["slo_class"] == name]
        done = [r for r in rs if r["status"] == 200]
        added = [r["gateway_ttft_ms"] - r["worker_ttft_ms"] for r in done
                 if r["gateway_ttft_ms"] is not None and r["worker_ttft_ms"] is not None]
        out[name] = {"requests": len(rs), "refused": sum(r["refused"] for r in rs),
                     "failed": sum(r["status"] != 200 and not r["refused"] for r in rs),
                     "queued": sum(bool(r.get("queued")) for r in done),
                     "gateway_attainment": sum(bool(r["gateway_slo_met"]) for r in done) / len(rs),
                     "worker_attainment": sum(bool(r["worker_slo_met"]) for r in done) / len(rs),
                     "mean_gateway_ttft_ms": _mean([r["gateway_ttft_ms"] for r in done if r["gateway_ttft_ms"]]),
                     "mean_worker_ttft_ms": _mean([r["worker_ttft_ms"] for r in done if r["worker_ttft_ms"]]),
                     "mean_ttft_added_ms": _mean(added), "max_ttft_added_ms": max(added) if added else None,
                     "mean_worker_tpot_ms": _mean([r["worker_tpot_ms"] for r in done if r["worker_tpot_ms"]])}
    return {"per_class": out, "requests": list(rows)}


async def measure_sequential(cfg: LoadConfig, classes: tuple[SLOClass, ...], *, each: int) -> dict[str, Any]:
    """``each`` requests of every class of the mix, one at a time (the class's own prompts and lengths)."""
    mix = cfg.mix or default_mix(classes)
    pool = build(dataclasses.replace(cfg, duration_s=max(60.0, 10.0 * each)), classes, 10.0)
    rows = []
    async with httpx.AsyncClient(timeout=cfg.timeout_s) as client:
        for name in mix:
            for req in [r for r in pool if r.slo_class == name][:each]:
                rows.append(await _one_json(client, cfg, req))
    return sequential_report(rows)


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
    """Per class against load: attainment of all requests and of the admitted ones, refused share, goodput and
    median TTFT; each system a line style (solid: the first, dashed: the plain load balancer)."""
    from adaserve.plots import panels

    with panels(path, 5, width=4.4, height=4.0) as (fig, axes):
        _draw_load(report, fig, axes)


STYLES = ("-", "--", ":")


def _x(report: dict[str, Any], row: dict[str, Any]) -> float:
    return row["load"] if report.get("capacity") and row.get("load") is not None else row["rate_rps"]


def _draw_load(report: dict[str, Any], fig: Any, axes: list[Any]) -> None:
    systems = report.get("systems") or {"gateway": {"rates": report["rates"]}}
    colors: dict[str, Any] = {}
    panels = [("slo_attainment", 100, "SLO attainment, all requests (%)", (0, 105)),
              ("admitted_attainment", 100, "SLO attainment, admitted requests (%)", (0, 105)),
              ("refused_share", 100, "refused (%)", (0, 105)),
              ("goodput_tok_s", 1, "goodput (tokens/s)", None),
              ("p50_ttft_ms", 1e-3, "median TTFT of admitted (s)", None)]
    for (name, system), style in zip(systems.items(), STYLES, strict=False):
        rows = system["rates"]
        xs = [_x(report, r) for r in rows]
        for ax, (key, scale, _, _) in zip(axes, panels, strict=True):
            for c in report["classes"]:
                got = [r["per_class"].get(c["name"]) for r in rows]
                if not any(got):
                    continue
                pts = [(x, g[key] * scale) for x, g in zip(xs, got, strict=True) if g and g.get(key) is not None]
                if not pts:
                    continue
                line, = ax.plot(*zip(*pts, strict=True), style, marker="o", markersize=3,
                                color=colors.get(c["name"]), label=f"{c['name']} ({c['tpot_ms']:g} ms), {name}")
                colors.setdefault(c["name"], line.get_color())
            if key == "goodput_tok_s":
                ax.plot(xs, [r[key] for r in rows], style, color="k", linewidth=2, label=f"all, {name}")
    xlabel = "offered load (x capacity)" if report.get("capacity") else "request rate (req/s)"
    for ax, (_, _, ylabel, ylim) in zip(axes, panels, strict=True):
        ax.set(xlabel=xlabel, ylabel=ylabel)
        if ylim:
            ax.set_ylim(*ylim)
    axes[0].legend(fontsize=6)
    axes[3].legend(fontsize=6)
    cap = report.get("capacity") or {}
    extra = f", capacity {cap['capacity_rps']:.2f} req/s" if cap.get("capacity_rps") else ""
    fig.suptitle(f"model {report['model']}; solid: {' / dashed: '.join(systems)}{extra}", fontsize=9)
