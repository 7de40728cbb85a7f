"""Prometheus metrics of one worker, in a registry of its own (``adaserve_*``, docs/worker.md "Metrics").

Fed from three places, all on the engine thread: ``Engine.step_listeners`` (one call per iteration), each
request's token events (inter-token latency) and request completions. Gauges that describe the engine's
state now (queue length, KV use) are read when scraped, so an abort between iterations shows at once.

Every series carries a ``model_name`` label (the served name): the metrics live in an inner registry, and
the one scraped adds the label to each sample (``_WithModelName``), so no metric can forget it. The queue,
running and KV gauges are also exported under vLLM's names, which the Gateway API Inference Extension's
model-server protocol and the usual KEDA/HPA recipes read (``VLLM_ALIASES``; the mapping is in docs/worker.md).
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict, deque
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from adaserve.contract.slo import slo_met
from adaserve.engine.engine import Engine, StepMetrics
from adaserve.engine.model.kv_cache import PagedKVCache
from adaserve.engine.request import Request

# The GIE model-server protocol's metrics (docs/proposals/003-model-server-protocol) under the names its endpoint
# picker and the usual recipes read by default: vLLM's. Each is the adaserve_* gauge of the same meaning.
VLLM_ALIASES = {
    "vllm:num_requests_waiting": "adaserve_queue_length",  # TotalQueuedRequests
    "vllm:num_requests_running": "adaserve_running_requests",  # TotalRunningRequests
    "vllm:gpu_cache_usage_perc": "adaserve_kv_cache_usage_ratio",  # KVCacheUtilization (vLLM v0's name)
    "vllm:kv_cache_usage_perc": "adaserve_kv_cache_usage_ratio",  # the same, vLLM v1's name
}
LENGTH_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)


class _WithModelName(Collector):
    """Every series of ``inner`` with ``model_name="<name>"`` added, as vLLM labels its own."""

    def __init__(self, inner: CollectorRegistry, model_name: str) -> None:
        self.inner, self.model_name = inner, model_name

    def collect(self) -> Iterator[Metric]:
        for family in self.inner.collect():
            out = Metric(family.name, family.documentation, family.type, family.unit)
            out.samples = [s._replace(labels={**s.labels, "model_name": self.model_name}) for s in family.samples]
            yield out


class _PrefixCache(Collector):
    """Prefix caching's series, read from the target's cache when scraped (kv_cache.py, prefix_cache.py): its
    totals are the cache's own counts, so nothing can drift from them; zeros until bound, and while it is off."""

    def __init__(self) -> None:
        self.cache: PagedKVCache | None = None

    def collect(self) -> Iterator[Metric]:
        c = self.cache
        stats, pages = (c.prefix_stats, c.cached_pages) if c is not None else (None, 0)
        queried, hits, evictions = (stats.queried_tokens, stats.hit_tokens, stats.evictions) if stats else (0, 0, 0)
        yield CounterMetricFamily("adaserve_prefix_cache_queries", "Prompt tokens looked up in the prefix cache "
                                  "(as vLLM's prefix_cache_queries)", value=queried)
        yield CounterMetricFamily("adaserve_prefix_cache_hits", "Prompt tokens whose KV came from the prefix cache, "
                                  "not prefilled (as vLLM's prefix_cache_hits)", value=hits)
        yield GaugeMetricFamily("adaserve_prefix_cache_hit_ratio", "Prefix cache hits / queries in tokens, since "
                                "start", value=hits / queried if queried else 0.0)
        yield GaugeMetricFamily("adaserve_prefix_cache_pages", "Target KV pages the prefix cache keeps, held by a "
                                "request or idle (idle ones count as free in adaserve_kv_cache_used_pages)",
                                value=pages)
        yield CounterMetricFamily("adaserve_prefix_cache_evictions", "Idle cached pages evicted for a new use",
                                  value=evictions)


class WorkerMetrics:
    def __init__(self, *, model_name: str = "unknown", acceptance_window: int = 64) -> None:
        self.model_name = model_name
        r = CollectorRegistry(auto_describe=True)
        self.registry = CollectorRegistry(auto_describe=True)  # what /metrics serves: r's series, labelled
        self.registry.register(_WithModelName(r, model_name))
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
        self.tokens_verified = Counter("adaserve_tokens_verified", "Tree tokens sent to verification, one root per "
                                       "request included (not the denominator of acceptance: see "
                                       "adaserve_spec_draft_tokens)", registry=r)
        self.tokens_accepted = Counter("adaserve_tokens_accepted", "Draft tokens the target accepted", registry=r)
        # acceptance = accepted / drafted, as vLLM's spec_decode_num_accepted_tokens / num_draft_tokens
        self.spec_draft_tokens = Counter("adaserve_spec_draft_tokens", "Draft tokens proposed for verification: "
                                         "every tree node but the roots", registry=r)
        self.spec_accepted_tokens = Counter("adaserve_spec_accepted_tokens", "Draft tokens the target accepted "
                                            "(of adaserve_spec_draft_tokens)", registry=r)
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
        self.inter_token_latency = Histogram(
            "adaserve_inter_token_latency_seconds", "Time between output tokens: an iteration's time since the "
            "request's last tokens, shared by the tokens it gave (one observation per token after the first)",
            ["slo_class"], registry=r,
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5))
        self.e2e_latency = Histogram(
            "adaserve_e2e_request_latency_seconds", "From the engine's arrival to the end, per finished request",
            ["slo_class"], registry=r, buckets=(0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0))
        self.queue_time = Histogram(
            "adaserve_request_queue_time_seconds", "From the engine's arrival to the start of the first iteration "
            "it ran in (waiting for KV admission)", ["slo_class"], registry=r,
            buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0))
        self.prompt_tokens = Histogram("adaserve_request_prompt_tokens", "Prompt tokens per finished request (a "
                                       "continuation's earlier output not included)", ["slo_class"], registry=r,
                                       buckets=LENGTH_BUCKETS)
        self.generation_tokens = Histogram("adaserve_request_generation_tokens", "Output tokens per finished "
                                           "request", ["slo_class"], registry=r, buckets=LENGTH_BUCKETS)
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
        self.vllm = {name: Gauge(name, f"vLLM's name of {ours} (the GIE model-server protocol)", registry=r)
                     for name, ours in VLLM_ALIASES.items()}
        self.prefix_cache = _PrefixCache()
        r.register(self.prefix_cache)

        self._draft_names: list[str] = []  # by the engine's draft index, when there are several
        self._lock = threading.Lock()
        self._finished: dict[str, int] = defaultdict(int)
        self._met: dict[str, int] = defaultdict(int)
        self._recent: deque[tuple[int, int, int]] = deque(maxlen=acceptance_window)  # accepted, verifs, proposed
        # per request in flight, on the engine thread: its class, its last tokens' time, whether it was admitted
        self._clock: Callable[[], float] = time.perf_counter
        self._engine: Engine | None = None
        self._classes: dict[str, str] = {}
        self._last_token: dict[str, float] = {}
        self._admitted: set[str] = set()
        self._last_step_end: float | None = None

    def bind_engine(self, engine: Engine) -> None:
        """Start reading engine state at scrape time and listening to its iterations."""
        cache = engine.target.cache
        self.budget.set(engine.cfg.budget)
        self.kv_total_pages.set(cache.num_pages)
        self.kv_usage.set_function(engine.kv_usage)
        self.kv_used_pages.set_function(lambda: cache.num_pages - cache.free_pages)
        self.prefix_cache.cache = cache
        self.queue_length.set_function(lambda: len(engine.waiting))
        self.running.set_function(lambda: len(engine.running))
        reads = {"adaserve_queue_length": lambda: len(engine.waiting),
                 "adaserve_running_requests": lambda: len(engine.running),
                 "adaserve_kv_cache_usage_ratio": engine.kv_usage}
        for name, ours in VLLM_ALIASES.items():
            self.vllm[name].set_function(reads[ours])
        self._clock, self._engine = engine.clock, engine
        engine.step_listeners.append(self.on_step)

    def declare_classes(self, names: list[str]) -> None:
        """Create the per-class series up front so dashboards see zeros, not gaps."""
        for name in names:
            for labelled in (self.active, self.output_tokens, self.goodput_tokens, self.inter_token_latency,
                             self.e2e_latency, self.queue_time, self.prompt_tokens, self.generation_tokens):
                labelled.labels(name)

    def declare_drafts(self, names: list[str]) -> None:
        """Name the engine's drafts, in its order, so each draft's series exists (at zero) from the start."""
        self._draft_names = list(names) if len(names) > 1 else []
        for name in self._draft_names:
            self.draft_verifications.labels(name)

    # ---- feeds (engine thread) ---------------------------------------------------------------------
    def track(self, request_id: str, slo_class: str) -> None:
        """A request about to reach the engine (event loop): its class, for the series observed before it ends."""
        self._classes[request_id] = slo_class

    def forget(self, request_id: str) -> None:
        """A tracked request the engine refused: it will never finish."""
        self._classes.pop(request_id, None)

    def on_tokens(self, request_id: str, n: int) -> None:
        """A request's ``n`` new tokens, as the engine emits them: after its first, each token is one
        observation of inter-token latency, the time since its previous tokens shared by the ``n``."""
        if n <= 0:
            return
        now = self._clock()
        last = self._last_token.get(request_id)
        self._last_token[request_id] = now
        if last is not None:
            h = self.inter_token_latency.labels(self._classes.get(request_id, "unknown"))
            for _ in range(n):
                h.observe((now - last) / n)

    def on_step(self, m: StepMetrics) -> None:
        now = self._clock()
        if self._engine is not None:  # a request's first iteration ends its queue time
            start = now - m.t_step_s
            for req in self._engine.running:
                if req.request_id in self._classes and req.request_id not in self._admitted:
                    self._admitted.add(req.request_id)
                    self.queue_time.labels(self._classes[req.request_id]).observe(
                        max(0.0, start - req.metrics.arrival_s))
        self._last_step_end = now
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
            self.spec_draft_tokens.inc(m.tokens_verified - m.n_decode)  # each decoding request's tree has one root
            self.spec_accepted_tokens.inc(m.tokens_accepted)
            with self._lock:
                self._recent.append((m.tokens_accepted, m.n_decode, m.tokens_verified - m.n_decode))

    def on_finished(self, req: Request, *, slo_class: str, tpot_slo_ms: float | None, ttft_slo_ms: float | None,
                    reason: str | None) -> bool:
        """Record a finished request; returns whether it met its SLO (adaserve/contract/slo.py)."""
        met = slo_met(reason, tpot_ms=req.metrics.tpot_ms, ttft_ms=req.metrics.ttft_ms, tpot_target_ms=tpot_slo_ms,
                      ttft_target_ms=ttft_slo_ms)
        n = len(req.output_ids)
        self._finished_request(req, slo_class)
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

    def _finished_request(self, req: Request, slo_class: str) -> None:
        """Latency and length histograms of a request the engine is done with; forgets its per-request state."""
        rid = req.request_id
        now = self._clock()
        if rid not in self._admitted and req.metrics.first_token_s is not None:
            # admitted and finished within one iteration, before on_step saw it: that iteration began about when
            # the one before it ended (or at its arrival, if the engine was idle)
            start = max(req.metrics.arrival_s, self._last_step_end or req.metrics.arrival_s)
            self.queue_time.labels(slo_class).observe(max(0.0, start - req.metrics.arrival_s))
        self.e2e_latency.labels(slo_class).observe(max(0.0, now - req.metrics.arrival_s))
        self.prompt_tokens.labels(slo_class).observe(len(req.prompt_ids) - req.resumed)
        self.generation_tokens.labels(slo_class).observe(len(req.output_ids))
        self._classes.pop(rid, None)
        self._last_token.pop(rid, None)
        self._admitted.discard(rid)

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

