"""calibration.py and load.py: the correction learnt from predicted against observed TPOT, and the load a request
decoded under, by hand."""

from __future__ import annotations

import math

import pytest

from adaserve.gateway.calibration import LIMIT, MIN_TOKENS, RATE, TTFT_WINDOW, Calibration, learn
from adaserve.gateway.load import OwnLoad, effective, mean_level


def test_constants_the_hand_numbers_assume() -> None:
    assert (RATE, LIMIT, MIN_TOKENS) == (0.2, 4.0, 8)


def test_learn_moves_a_fifth_of_the_way_in_log_space() -> None:
    assert learn(1.0, 10.0, 20.0) == pytest.approx(2 ** 0.2)
    assert learn(2.0, 10.0, 10.0) == pytest.approx(2 ** 0.8)  # an exact prediction pulls back towards 1
    assert learn(1.0, 20.0, 10.0) == pytest.approx(0.5 ** 0.2)  # symmetric: twice too fast weighs the same


def test_learn_is_bounded_and_ignores_what_is_not_a_measurement() -> None:
    assert learn(3.9, 1.0, 1e6) == LIMIT and learn(0.26, 1e6, 1.0) == 1 / LIMIT
    for predicted, observed in ((0.0, 10.0), (10.0, 0.0), (math.nan, 10.0), (10.0, math.inf)):
        assert learn(1.5, predicted, observed) == 1.5


def test_a_steady_bias_is_learnt_and_then_corrected_for() -> None:
    # every request on w is 1.5x slower than predicted: the corrected prediction converges on what it gets
    cal = Calibration()
    for _ in range(30):
        cal.observe("w", predicted_ms=40.0, observed_ms=60.0, tokens=64)
    assert cal.correction("w") == pytest.approx(1.5, rel=1e-3) and cal.observations["w"] == 30
    assert cal.correction("other") == 1.0


def test_short_or_unpredicted_requests_teach_nothing() -> None:
    cal = Calibration()
    assert cal.observe("w", predicted_ms=10.0, observed_ms=50.0, tokens=MIN_TOKENS - 1) == 1.0
    assert cal.observe("w", predicted_ms=None, observed_ms=50.0, tokens=64) == 1.0
    assert cal.observe("w", predicted_ms=10.0, observed_ms=None, tokens=64) == 1.0
    assert cal.observations == {}


# ---- load.py ----------------------------------------------------------------------------------------------------

def test_effective_load_counts_others_as_written_and_own_as_now() -> None:
    # written when this gateway had 2 chat there; the worker counted 3: one is someone else's
    assert effective({"chat": 3}, {"chat": 1, "coding": 1}, {"chat": 2}) == {"chat": 2, "coding": 1}
    assert effective({"chat": 1}, {}, {"chat": 2}) == {"chat": 0}  # the worker had not seen ours yet
    assert effective({"chat": 1}, {"chat": 3}, None) == {"chat": 3}  # when it was written is unknown: the larger


def test_own_counts_are_remembered_by_wall_time() -> None:
    own = OwnLoad()
    own.change("chat", +1, wall=100.0)
    own.change("chat", +1, wall=101.0)
    own.change("chat", -1, wall=102.0)
    assert own.at(99.0) == {} and own.at(100.5) == {"chat": 1} and own.at(101.5) == {"chat": 2}
    assert own.at(500.0) == {"chat": 1} == dict(own.now)
    own.change("chat", -5, wall=103.0)  # never below zero
    assert own.now["chat"] == 0 and own.at(103.0) == {}
    own.change("chat", +1, wall=400.0)  # older history beyond the horizon goes; the last entry before it stays
    assert own.at(350.0) == {} and len(own.history) == 2


def test_mean_level_is_the_time_average_of_the_load() -> None:
    own = OwnLoad(t_area=0.0)
    start = own.tick(1, now=0.0)
    own.tick(3, now=1.0)  # 1 request for 1 s
    end = own.tick(2, now=2.0)  # 3 requests for 1 s
    assert mean_level(start, end) == pytest.approx(2.0)
    assert mean_level(end, end) is None


def test_time_from_admission_to_first_token_per_class() -> None:
    cal = Calibration()
    assert cal.ttft_after_admission_ms("coding") is None
    for ms in (100.0, 400.0, 200.0, 300.0):
        cal.observe_ttft("coding", ms)
    cal.observe_ttft("coding", None)  # no first token: nothing to learn
    cal.observe_ttft("coding", -5.0)
    assert cal.ttft_after_admission_ms("coding") == 400.0  # the 75th percentile of 100..400
    for _ in range(TTFT_WINDOW):  # only the last TTFT_WINDOW count
        cal.observe_ttft("coding", 50.0)
    assert cal.ttft_after_admission_ms("coding") == 50.0 and cal.ttft_after_admission_ms("chat") is None
