"""Prediction and correction on worker states recorded from a real SmolLM2-135M-Instruct worker under load
(tests/gateway/unit/recorded/smollm2-cpu-states.json says how they were recorded)."""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
from pathlib import Path
from typing import Any

import pytest

from adaserve.contract.registration import parse_registration
from adaserve.gateway.calibration import Calibration
from adaserve.gateway.directory import worker_view
from adaserve.gateway.prediction import predicted_tpot_ms
from adaserve.gateway.routing import best_slack, feasible_anywhere, slack
from adaserve.gateway.view import WorkerView

RECORDED = json.loads((Path(__file__).parent / "recorded" / "smollm2-cpu-states.json").read_text())
# the classes the recorded run served (its --slo-classes-file), and admission's default margin
TARGETS = {"coding": 350.0, "chat": 450.0, "summarization": 900.0}
MARGIN = 0.1


def admission_target(name: str) -> float | None:
    t = TARGETS.get(name)
    return None if t is None else t * (1 - MARGIN)


def state(name: str) -> tuple[dict[str, Any], WorkerView]:
    doc = RECORDED[name]
    reg = parse_registration(doc)
    assert reg is not None, f"recorded {name} state is no registration any more"
    return doc, worker_view(reg)


def lone_observed() -> dict[str, float]:
    """What the lone requests of each class got, as the worker measured them."""
    doc, _ = state("lone")
    return {c: r["tpot_ms"] for c, r in doc["measured"]["classes"].items()}


def test_a_lone_requests_tpot_is_predicted_within_30_percent_for_every_class() -> None:
    _, w = state("lone")
    observed = lone_observed()
    assert set(observed) == set(TARGETS)
    for name, got in observed.items():
        predicted = predicted_tpot_ms(w, name, 1)
        assert predicted is not None and abs(predicted / got - 1) < 0.3, (name, predicted, got)
    # the classes differ by a factor of three, as the requests did: one pooled figure could not say so
    assert predicted_tpot_ms(w, "summarization", 1) > 2.5 * predicted_tpot_ms(w, "chat", 1)  # type: ignore[operator]


def test_the_correction_learnt_from_those_requests_brings_the_predictions_closer() -> None:
    _, w = state("lone")
    observed = lone_observed()
    cal = Calibration()
    for _ in range(10):  # the same requests again and again: a steady bias is learnt
        for name, got in observed.items():
            cal.observe(w.id, predicted_ms=predicted_tpot_ms(w, name, 1), observed_ms=got, tokens=64)
    k = cal.correction(w.id)

    def error(correction: float) -> float:
        return statistics.median(abs(math.log(correction * predicted_tpot_ms(w, n, 1) / got))  # type: ignore[operator]
                                 for n, got in observed.items())

    assert k < 1.0  # the recorded curve was pessimistic for lone requests (it includes their prefill steps)
    assert error(k) < error(1.0)
    assert error(k) < 0.15


def test_every_class_is_feasible_and_an_idle_worker_takes_each_at_once() -> None:
    _, recorded = state("lone")  # recorded as the next phase began: that worker, idle
    w = dataclasses.replace(recorded, active=0, active_by_class={})
    for name in TARGETS:
        assert feasible_anywhere([w], name, admission_target)
        assert slack(w, name, admission_target) >= 0


def test_the_recorded_busy_worker_has_no_slack_for_any_class() -> None:
    doc, w = state("busy")
    assert w.active == doc["load"]["active"] >= 6 and len(w.curve) >= 12
    for name in TARGETS:
        assert best_slack([w], name, admission_target) < 0  # type: ignore[operator]
        # what it predicts for the classes there now is of the order they recently got (mixed loads)
        got = doc["measured"]["classes"][name]["tpot_ms"]
        assert 0.5 < predicted_tpot_ms(w, name, w.active) / got < 3.0  # type: ignore[operator]


def test_prediction_grows_with_the_load_on_the_recorded_curve() -> None:
    _, w = state("busy")
    for name in TARGETS:
        at = [predicted_tpot_ms(w, name, n) for n in (1, 5, 10, 20)]
        assert all(a is not None for a in at)
        assert at[0] < at[1] and at[0] < at[2] and at[1] < at[3], (name, at)  # type: ignore[operator]


@pytest.mark.parametrize("name", sorted(TARGETS))
def test_per_class_figures_were_recorded(name: str) -> None:
    doc, _ = state("busy")
    assert any(name in p["tokens_by_class"] for p in doc["measured"]["iterations"])
