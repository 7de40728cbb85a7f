"""Prometheus metrics of the gateway, per SLO class (``adaserve_gateway_*``, docs/gateway.md "Metrics")."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5)


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("adaserve_gateway_requests", "Requests sent to a worker (retries count once)",
                                ["slo_class"], registry=r)
        # every request in requests_total is in_flight, then in exactly one outcome (done | aborted | failed |
        # rejected): requests_total = sum(finished_total) + in_flight, at any scrape
        self.finished = Counter("adaserve_gateway_finished", "Requests sent to a worker that ended, by outcome "
                                "(done | aborted | failed | rejected)", ["slo_class", "outcome"], registry=r)
        self.in_flight = Gauge("adaserve_gateway_in_flight", "Requests sent to a worker and not yet ended",
                               ["slo_class"], registry=r)
        self.slo = Counter("adaserve_gateway_slo_requests", "Finished requests by SLO outcome (met|missed)",
                           ["slo_class", "outcome"], registry=r)
        self.attainment = Gauge("adaserve_gateway_slo_attainment",
                                "Share of finished requests that met their SLO, since start", ["slo_class"],
                                registry=r)
        self.output_tokens = Counter("adaserve_gateway_output_tokens", "Output tokens streamed", ["slo_class"],
                                     registry=r)
        self.goodput_tokens = Counter("adaserve_gateway_goodput_tokens",
                                      "Output tokens of requests that met their SLO (rate() = goodput)",
                                      ["slo_class"], registry=r)
        self.ttft = Histogram("adaserve_gateway_ttft_seconds", "Time to first token, measured at the gateway",
                              ["slo_class"], buckets=TTFT_BUCKETS, registry=r)
        self.tpot = Histogram("adaserve_gateway_tpot_seconds", "Mean time per output token after the first",
                              ["slo_class"], buckets=TPOT_BUCKETS, registry=r)
        self.shed = Counter("adaserve_gateway_shed", "Requests refused for lack of capacity",
                            ["slo_class", "reason"], registry=r)
        self.rate_limited = Counter("adaserve_gateway_rate_limited", "Requests refused by a key's rate limit",
                                    ["api_key"], registry=r)
        self.retries = Counter("adaserve_gateway_retries", "Requests re-sent to another worker before a token",
                               ["slo_class"], registry=r)
        self.routed = Counter("adaserve_gateway_routing_choices", "Requests sent to each worker",
                              ["worker", "slo_class", "policy"], registry=r)
        # prefix affinity (prefix_index.py): the routing's hit rate at the gateway, by requests and by blocks
        self.prefix_requests = Counter(
            "adaserve_gateway_prefix_requests", "Requests with at least one whole block of text, by what prefix "
            "affinity found: hit (sent to a worker holding part of its prefix), miss (no worker with headroom held "
            "any), no_headroom (a worker without headroom held more of it than the one chosen)", ["result"],
            registry=r)
        self.prefix_moved = Counter("adaserve_gateway_prefix_routed", "Requests sent elsewhere than the routing "
                                    "policy's pick, to the worker holding the longest prefix of them", registry=r)
        self.prefix_blocks = Counter("adaserve_gateway_prefix_blocks", "Blocks of text of requests routed (what: "
                                     "sent), and of those the chosen worker was estimated to hold (what: matched)",
                                     ["what"], registry=r)
        self.admitted = Counter("adaserve_gateway_admitted", "Requests admitted, by how (at_once | after_wait) "
                                "and mode (slo | best_effort | late | plain)", ["slo_class", "how", "mode"],
                                registry=r)
        self.queue_wait = Histogram("adaserve_gateway_queue_seconds", "Time a request waited in admission",
                                    ["slo_class"], buckets=(0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0),
                                    registry=r)
        self.correction = Gauge("adaserve_gateway_tpot_correction",
                                "Observed over predicted TPOT learnt per worker (1 = the prediction holds)",
                                ["worker"], registry=r)
        self.queued = Gauge("adaserve_gateway_queued", "Requests waiting for headroom now", registry=r)
        self.workers = Gauge("adaserve_gateway_workers", "Workers the gateway can route to", registry=r)
        for result in ("hit", "miss", "no_headroom"):
            self.prefix_requests.labels(result)
        for what in ("sent", "matched"):
            self.prefix_blocks.labels(what)
        self._finished: dict[str, int] = {}
        self._met: dict[str, int] = {}

    def declare(self, classes: list[str]) -> None:
        """Zero series for every class, so dashboards show 0 rather than nothing."""
        for c in classes:
            self.requests.labels(c)
            self.in_flight.labels(c)
            self.output_tokens.labels(c)
            self.goodput_tokens.labels(c)
            self.retries.labels(c)

    def on_slo(self, slo_class: str, *, met: bool, tokens: int) -> None:
        self.slo.labels(slo_class, "met" if met else "missed").inc()
        self._finished[slo_class] = self._finished.get(slo_class, 0) + 1
        self._met[slo_class] = self._met.get(slo_class, 0) + int(met)
        self.attainment.labels(slo_class).set(self._met[slo_class] / self._finished[slo_class])
        if met:
            self.goodput_tokens.labels(slo_class).inc(tokens)
