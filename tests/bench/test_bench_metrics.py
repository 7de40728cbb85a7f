from __future__ import annotations

import pytest

from adaserve.bench.metrics import RequestResult, adaserve_ratios, summarize


def res(rid: str, cls: str, slo: float, tpot: float | None, tokens: int = 10, reason: str = "length") -> RequestResult:
    return RequestResult(rid, cls, slo, tokens, tpot, 5.0, (1, 2), reason)


def test_attainment_goodput_and_classes() -> None:
    rs = [res("a", "coding", 10, 8), res("b", "coding", 10, 12), res("c", "chat", 50, 49, tokens=20),
          res("d", "chat", 50, None, tokens=1), res("e", "chat", 50, 1, reason="abort")]
    s = summarize(rs, wall_s=2.0, select_s=0.1, step_s=1.0)
    assert s["requests"] == 5 and s["violations"] == 2
    assert s["slo_attainment"] == pytest.approx(3 / 5)
    assert s["goodput_tok_s"] == pytest.approx((10 + 20 + 1) / 2)
    assert s["throughput_tok_s"] == pytest.approx((10 + 10 + 20 + 1 + 10) / 2)
    assert s["per_class"]["coding"]["slo_attainment"] == 0.5
    assert s["per_class"]["chat"]["requests"] == 3
    assert s["scheduler_time_share"] == pytest.approx(0.1)
    assert s["mean_accepted_per_verification"] == pytest.approx(1.5)
    with pytest.raises(ValueError):
        summarize(rs, wall_s=0)


def test_ratios_against_best_other() -> None:
    by = {"adaserve": {"slo_attainment": 0.9, "goodput_tok_s": 90.0, "violations": 1},
          "incremental": {"slo_attainment": 0.6, "goodput_tok_s": 60.0, "violations": 4},
          "chain:4": {"slo_attainment": 0.75, "goodput_tok_s": 45.0, "violations": 2}}
    r = adaserve_ratios(by)
    assert r is not None
    assert r["attainment_vs_best"] == pytest.approx(0.9 / 0.75) and r["best_attainment_policy"] == "chain:4"
    assert r["goodput_vs_best"] == pytest.approx(1.5) and r["best_goodput_policy"] == "incremental"
    assert r["violation_reduction_vs_best"] == pytest.approx(2.0)
    assert adaserve_ratios({"adaserve": by["adaserve"]}) is None


def test_goodput_over_the_window_and_the_makespan() -> None:
    # 30 SLO-met tokens; the drain ran 5 s past a 3 s arrival window
    rs = [res("a", "coding", 10, 8, tokens=12), res("b", "coding", 10, 12, tokens=7),
          res("c", "chat", 50, 49, tokens=18)]
    s = summarize(rs, wall_s=8.0, window_s=3.0)
    assert s["goodput_tok_s"] == pytest.approx(30 / 8)
    assert s["goodput_window_tok_s"] == pytest.approx(30 / 3)
    assert s["window_s"] == 3.0
    assert s["per_class"]["coding"]["goodput_window_tok_s"] == pytest.approx(12 / 3)
    assert s["per_class"]["chat"]["goodput_tok_s"] == pytest.approx(18 / 8)
    assert s["per_class"]["chat"]["goodput_window_tok_s"] == pytest.approx(18 / 3)
    none = summarize(rs, wall_s=8.0)  # no window given: no window goodput
    assert none["goodput_window_tok_s"] is None and none["per_class"]["chat"]["goodput_window_tok_s"] is None
