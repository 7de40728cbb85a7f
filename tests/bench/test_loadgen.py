"""The load generator's pure parts: client-side timing, classes from the gateway, the per-rate report."""

from __future__ import annotations

import math

import pytest

from adaserve.bench.loadgen import (
    REFUSED,
    LoadConfig,
    Timing,
    build,
    classes_from,
    default_mix,
    mean_tokens,
    met,
    overhead_report,
    prediction_report,
    rate_report,
    refusals_between,
    sequential_report,
)
from adaserve.bench.metrics import RequestResult
from adaserve.contract.slo import slo_met

PUBLISHED = {"default": "chat", "data": [
    {"name": "coding", "tpot_ms": 40, "ttft_ms": 2000, "priority": 10, "sheddable": False},
    {"name": "chat", "tpot_ms": 50, "ttft_ms": None, "priority": 0, "sheddable": False},
    {"name": "batch", "tpot_ms": 500, "ttft_ms": None, "priority": -1, "sheddable": True},
]}


def result(cls: str, *, tokens: int, tpot: float | None, finish: str | None, slo: float = 50.0) -> RequestResult:
    return RequestResult(request_id=f"{cls}-{tokens}-{finish}", slo_class=cls, tpot_slo_ms=slo, tokens=tokens,
                         tpot_ms=tpot, ttft_ms=None if tpot is None else 10.0, accepted_per_step=(),
                         finish_reason=finish)


def test_timing_spreads_the_tokens_after_the_first_over_the_stream() -> None:
    t = Timing(sent=1.0, first=1.2, last=2.2, tokens=11)  # 10 tokens after the first in 1 s
    assert t.ttft_ms() == pytest.approx(200.0)
    assert t.tpot_ms() == pytest.approx(100.0)
    assert Timing(1.0, 1.2, 1.2, 1).tpot_ms() is None  # one token: no per-token latency
    assert Timing(1.0, None, None, 0).ttft_ms() is None


def test_classes_from_the_gateway_and_a_default_mix_over_those_with_prompts() -> None:
    classes = classes_from(PUBLISHED)
    assert [(c.name, c.tpot_ms) for c in classes] == [("coding", 40.0), ("chat", 50.0), ("batch", 500.0)]
    assert default_mix(classes) == {"coding": 0.5, "chat": 0.5}  # no prompt source for "batch"
    with pytest.raises(ValueError, match="prompt source"):
        default_mix(classes[2:])


def test_workload_carries_the_gateways_targets() -> None:
    cfg = LoadConfig(url="http://x", model="m", rates=(4.0,), duration_s=5.0)
    reqs = build(cfg, classes_from(PUBLISHED), 4.0)
    assert reqs and {r.slo_class for r in reqs} <= {"coding", "chat"}
    assert all(r.tpot_slo_ms == {"coding": 40.0, "chat": 50.0}[r.slo_class] for r in reqs)
    assert all(0 <= r.arrival_s < 5.0 for r in reqs)


def test_bad_rates_are_refused() -> None:
    with pytest.raises(ValueError, match="rates"):
        LoadConfig(url="http://x", model="m", rates=(0.0,))
    with pytest.raises(ValueError, match="rates"):
        LoadConfig(url="http://x", model="m", rates=())


def test_refused_and_failed_requests_count_as_misses_and_are_reported_apart() -> None:
    rs = [result("chat", tokens=20, tpot=30.0, finish="length"),   # met
          result("chat", tokens=20, tpot=80.0, finish="length"),   # too slow
          result("chat", tokens=0, tpot=None, finish=REFUSED),     # 503: no tokens, no TPOT, still a miss
          result("coding", tokens=0, tpot=None, finish="error")]   # the stream broke
    rep = rate_report(2.0, rs, wall_s=10.0, rule=slo_met, capacity_rps=4.0)
    assert rep["rate_rps"] == 2.0 and rep["load"] == 0.5 and rep["requests"] == 4
    assert rep["slo_attainment"] == pytest.approx(0.25)
    assert rep["admitted_attainment"] == pytest.approx(1 / 3)  # of the three that were not refused
    assert rep["refused"] == 1 and rep["failed"] == 1 and rep["refused_share"] == 0.25
    chat = rep["per_class"]["chat"]
    assert chat["refused"] == 1 and chat["slo_attainment"] == pytest.approx(1 / 3)
    assert chat["admitted_attainment"] == pytest.approx(0.5) and chat["refused_share"] == pytest.approx(1 / 3)
    assert rep["goodput_tok_s"] == pytest.approx(2.0)  # 20 tokens of the one met request over 10 s
    assert rep["throughput_tok_s"] == pytest.approx(4.0)
    assert "scheduler_time_share" not in rep  # engine-side figures are not visible from the client
    assert rate_report(2.0, rs, wall_s=10.0, rule=slo_met)["load"] is None


def test_a_class_with_a_ttft_target_is_judged_by_it_too() -> None:
    # the contract's one rule: TPOT within target and, for a class with one, TTFT too (10 ms here)
    rs = [result("coding", tokens=20, tpot=30.0, finish="length"), result("chat", tokens=20, tpot=30.0, finish="stop")]
    ttft = {"coding": 5.0, "chat": None}
    rep = rate_report(1.0, rs, wall_s=1.0, rule=slo_met, ttft_of=ttft.get)
    assert rep["per_class"]["coding"]["slo_attainment"] == 0.0 and rep["per_class"]["chat"]["slo_attainment"] == 1.0
    assert rep["per_class"]["coding"]["ttft_slo_ms"] == 5.0 and rep["p50_ttft_ms"] == 10.0
    assert met(rs[0], 50.0, slo_met) and not met(rs[0], 5.0, slo_met)


def test_mean_tokens_of_the_mix() -> None:
    cfg = LoadConfig(url="http://x", model="m", rates=(1.0,), mix={"coding": 1.0})
    assert mean_tokens(cfg, classes_from(PUBLISHED)) == pytest.approx((32 + 128) / 2, rel=0.05)  # U{32, 128}


def test_overhead_is_the_difference_of_medians() -> None:
    direct = [Timing(0.0, 0.020, 0.020 + 0.005 * 63, 64)] * 3
    gateway = [Timing(0.0, 0.025, 0.025 + 0.0055 * 63, 64)] * 3
    rep = overhead_report(direct, gateway)
    assert rep["requests_each"] == 3
    assert rep["ttft_ms"] == {"direct": 20.0, "gateway": 25.0, "added": 5.0}
    assert rep["tpot_ms"]["added"] == pytest.approx(0.5)


def test_sequential_report_sets_the_gateways_view_beside_the_workers() -> None:
    def row(cls: str, g: float, w: float, gm: bool, wm: bool, queued: bool = False) -> dict:
        return {"slo_class": cls, "status": 200, "refused": False, "queued": queued, "gateway_ttft_ms": g,
                "worker_ttft_ms": w, "gateway_tpot_ms": 30.0, "worker_tpot_ms": 29.0, "gateway_slo_met": gm,
                "worker_slo_met": wm}

    rows = [row("chat", 120.0, 100.0, True, True), row("chat", 150.0, 90.0, False, True, queued=True),
            {"slo_class": "chat", "status": 503, "refused": True}, row("coding", 60.0, 50.0, True, True)]
    rep = sequential_report(rows)
    chat = rep["per_class"]["chat"]
    assert (chat["requests"], chat["refused"], chat["failed"], chat["queued"]) == (3, 1, 0, 1)
    assert chat["gateway_attainment"] == pytest.approx(1 / 3) and chat["worker_attainment"] == pytest.approx(2 / 3)
    assert chat["mean_ttft_added_ms"] == pytest.approx(40.0) and chat["max_ttft_added_ms"] == 60.0
    assert rep["per_class"]["coding"]["gateway_attainment"] == 1.0 and rep["requests"] == rows


def test_prediction_report_from_the_gateways_records() -> None:
    records = [{"status": "done", "slo_class": "chat", "tpot_ms": "100.0", "predicted_tpot_ms": "50.0",
                "correction": "2.0", "decoding_load": "2.5", "queued": "0", "admission": "slo"},
               {"status": "done", "slo_class": "chat", "tpot_ms": "100.0", "predicted_tpot_ms": "100.0",
                "correction": "1.0", "decoding_load": "1.0", "queued": "1", "admission": "slo"},
               {"status": "aborted", "slo_class": "chat", "tpot_ms": "100.0", "predicted_tpot_ms": "10.0",
                "correction": "1.0"},
               {"status": "done", "slo_class": "coding", "tpot_ms": "", "predicted_tpot_ms": "10.0", "correction": "1"}]
    rep = prediction_report(records)
    assert rep["requests"] == 2 and rep["per_class"]["chat"]["requests"] == 2
    assert rep["median_abs_log_error_corrected"] == pytest.approx(0.0)
    assert rep["median_abs_log_error_raw"] == pytest.approx(math.log(2) / 2)
    assert rep["rows"][0] == {"slo_class": "chat", "observed_ms": 100.0, "predicted_ms": 50.0, "correction": 2.0,
                              "load": 2.5, "queued": False, "admission": "slo"}


def test_refusals_between_two_scrapes_of_the_gateways_metrics() -> None:
    from prometheus_client import generate_latest

    from adaserve.gateway.metrics import GatewayMetrics

    m = GatewayMetrics()
    m.shed.labels("chat", "overloaded").inc()
    before = generate_latest(m.registry).decode()
    m.shed.labels("chat", "overloaded").inc(2)
    m.shed.labels("summarization", "shed").inc()
    after = generate_latest(m.registry).decode()
    assert refusals_between(before, after) == {"chat": {"overloaded": 2}, "summarization": {"shed": 1}}
    assert refusals_between(after, after) == {}
    assert refusals_between("", after) == {"chat": {"overloaded": 3}, "summarization": {"shed": 1}}
