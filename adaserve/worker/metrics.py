"""Prometheus metrics of one worker, in a registry of its own (``adaserve_*``, docs/worker.md "Metrics").

Fed from two places: ``Engine.step_listeners`` (one call per iteration, on the engine thread) and
request completions (also on the engine thread). Gauges that describe the engine's state now (queue
length, KV use) are read when scraped, so an abort between iterations shows at once.
"""

from __future__ import annotations

import threading
from collections import defaultdict, deque

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from adaserve.contract.slo import slo_met
from adaserve.engine.engine import Engine, StepMetrics
from adaserve.engine.request import Request


class WorkerMetrics:
    def __init__(self, *, acceptance_window: int = 64) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.iterations = Counter("adaserve_iterations", "Engine iterations (steps)", registry=r)
        self.iteration_seconds = Histogram(
            "adaserve_iteration_seconds", "Wall time of one engine iteration", registry=r,
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5),
        )
        self.iteration_non_forward = Histogram(
            "adaserve_iteration_non_forward_ratio",
            "Share of an iteration's wall time outside model forwards (scheduling, selection, tree building, "
            "bookkeeping)", registry=r, buckets=(0.01, 0.02, 0.05, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0),
        )
        self.budget = Gauge("adaserve_budget_tokens", "Token budget B per verification", registry=r)
        self.budget_used = Histogram(
            "adaserve_budget_used_ratio", "Tree tokens verified / budget, per iteration with decoding",
            registry=r, buckets=(0.1, 0.25, 0.5, 0.75, 0.9, 1.0, 1.25, 1.5, 2.0),
        )
        self.tokens_verified = Counter("adaserve_tokens_verified", "Tree tokens sent to verification", registry=r)
        self.tokens_accepted = Counter("adaserve_tokens_accepted", "Draft tokens the target accepted", registry=r)
        self.tokens_emitted = Counter("adaserve_tokens_emitted", "Output tokens emitted", registry=r)
        self.prefill_tokens = Counter("adaserve_prefill_tokens", "Prompt tokens prefilled", registry=r)
        self.verifications = Counter("adaserve_verifications", "Per-request tree verifications", registry=r)
        self.accepted_per_verification = Histogram(
            "adaserve_accepted_tokens_per_verification",
            "Draft tokens accepted in one request's verification (observed when the request ends)",
            registry=r, buckets=(0, 1, 2, 3, 4, 5, 6, 8, 10, 12, 16),
        )
        self.draft_verifications = Counter(
            "adaserve_draft_verifications", "Per-request tree verifications by the draft that proposed the tree "
            "(workers with several drafts; counted when the request ends)", ["draft"], registry=r)
        self.requests = Counter("adaserve_requests", "Finished requests", ["slo_class", "finish_reason"], registry=r)
        self.slo_outcomes = Counter("adaserve_slo_requests", "Finished requests by SLO outcome",
                                    ["slo_class", "outcome"], registry=r)
        self.slo_attainment = Gauge("adaserve_slo_attainment",
                                    "Share of finished requests that met their SLO, since start",
                                    ["slo_class"], registry=r)
        self.output_tokens = Counter("adaserve_output_tokens", "Output tokens of finished requests",
                                     ["slo_class"], registry=r)
        self.goodput_tokens = Counter("adaserve_goodput_tokens", "Output tokens of requests that met their SLO",
                                      ["slo_class"], registry=r)
        self.ttft = Histogram("adaserve_ttft_seconds", "Time to first token", ["slo_class"], registry=r,
                              buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0))
        self.tpot = Histogram("adaserve_tpot_seconds", "Mean time per output token after the first",
                              ["slo_class"], registry=r,
                              buckets=(0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5))
        self.active = Gauge("adaserve_active_requests", "Requests admitted by the worker and not finished",
                            ["slo_class"], registry=r)
        self.rejected = Counter("adaserve_rejected_requests", "Requests refused before reaching the engine",
                                ["reason"], registry=r)
        self.queue_length = Gauge("adaserve_queue_length", "Requests waiting for KV admission", registry=r)
        self.running = Gauge("adaserve_running_requests", "Requests admitted to the engine", registry=r)
        self.kv_usage = Gauge("adaserve_kv_cache_usage_ratio", "Target KV cache pages in use / total", registry=r)
        self.kv_used_pages = Gauge("adaserve_kv_cache_used_pages", "Target KV cache pages in use", registry=r)
        self.kv_total_pages = Gauge("adaserve_kv_cache_pages", "Target KV cache pages in total", registry=r)
        self.ready = Gauge("adaserve_ready", "1 when serving (profiled, warmed up, not draining)", registry=r)
        self.draining = Gauge("adaserve_draining", "1 while draining after SIGTERM", registry=r)

        self._draft_names: list[str] = []  # by the engine's draft index, when there are several
        self._lock = threading.Lock()
        self._finished: dict[str, int] = defaultdict(int)
        self._met: dict[str, int] = defaultdict(int)
        self._recent: deque[tuple[int, int, int]] = deque(maxlen=acceptance_window)  # accepted, verifs, proposed

    def bind_engine(self, engine: Engine) -> None:
        """Start reading engine state at scrape time and listening to its iterations."""
        cache = engine.target.cache
        self.budget.set(engine.cfg.budget)
        self.kv_total_pages.set(cache.num_pages)
        self.kv_usage.set_function(engine.kv_usage)
        self.kv_used_pages.set_function(lambda: cache.num_pages - cache.free_pages)
        self.queue_length.set_function(lambda: len(engine.waiting))
        self.running.set_function(lambda: len(engine.running))
        engine.step_listeners.append(self.on_step)

    def declare_classes(self, names: list[str]) -> None:
        """Create the per-class series up front so dashboards see zeros, not gaps."""
        for name in names:
            self.active.labels(name)
            self.output_tokens.labels(name)
            self.goodput_tokens.labels(name)

    def declare_drafts(self, names: list[str]) -> None:
        """Name the engine's drafts, in its order, so each draft's series exists (at zero) from the start."""
        self._draft_names = list(names) if len(names) > 1 else []
        for name in self._draft_names:
            self.draft_verifications.labels(name)

    # ---- feeds (engine thread) ---------------------------------------------------------------------
    def on_step(self, m: StepMetrics) -> None:
        self.iterations.inc()
        self.iteration_seconds.observe(m.t_step_s)
        if m.t_wall_s > 0:
            self.iteration_non_forward.observe(m.non_forward_share)
        self.tokens_emitted.inc(m.tokens_emitted)
        self.prefill_tokens.inc(m.prefill_tokens)
        if m.n_decode:
            self.budget_used.observe(m.budget_used)
            self.tokens_verified.inc(m.tokens_verified)
            self.tokens_accepted.inc(m.tokens_accepted)
            self.verifications.inc(m.n_decode)
            with self._lock:
                self._recent.append((m.tokens_accepted, m.n_decode, m.tokens_verified - m.n_decode))

    def on_finished(self, req: Request, *, slo_class: str, tpot_slo_ms: float | None, ttft_slo_ms: float | None,
                    reason: str | None) -> bool:
        """Record a finished request; returns whether it met its SLO (adaserve/contract/slo.py)."""
        met = slo_met(reason, tpot_ms=req.metrics.tpot_ms, ttft_ms=req.metrics.ttft_ms, tpot_target_ms=tpot_slo_ms,
                      ttft_target_ms=ttft_slo_ms)
        n = len(req.output_ids)
        self.requests.labels(slo_class, reason or "error").inc()
        self.slo_outcomes.labels(slo_class, "met" if met else "missed").inc()
        self.output_tokens.labels(slo_class).inc(n)
        if met:
            self.goodput_tokens.labels(slo_class).inc(n)
        if req.metrics.ttft_ms is not None:
            self.ttft.labels(slo_class).observe(req.metrics.ttft_ms / 1e3)
        if req.metrics.tpot_ms is not None:
            self.tpot.labels(slo_class).observe(req.metrics.tpot_ms / 1e3)
        for a in req.metrics.accepted_per_step:
            self.accepted_per_verification.observe(a)
        if self._draft_names:
            for arm in req.metrics.drafts_per_step:  # the draft index of each of its verifications
                self.draft_verifications.labels(self._draft_names[arm]).inc()
        with self._lock:
            self._finished[slo_class] += 1
            self._met[slo_class] += int(met)
            self.slo_attainment.labels(slo_class).set(self._met[slo_class] / self._finished[slo_class])
        return met

    # ---- summaries for the registration ------------------------------------------------------------
    def recent_acceptance(self) -> dict[str, float | int]:
        with self._lock:
            acc = sum(a for a, _, _ in self._recent)
            verifs = sum(v for _, v, _ in self._recent)
            proposed = sum(p for _, _, p in self._recent)
            steps = len(self._recent)
        return {
            "steps": steps,
            "mean_accepted_per_verification": acc / verifs if verifs else 0.0,
            "acceptance_rate": acc / proposed if proposed else 0.0,
        }

    def attainment(self) -> dict[str, dict[str, float | int]]:
        with self._lock:
            return {c: {"finished": n, "met": self._met[c], "attainment": self._met[c] / n}
                    for c, n in self._finished.items()}

