"""worker/measurements.py: what a worker publishes as ``measured``, from engine iterations and finished requests."""

from __future__ import annotations

import threading

import pytest

from adaserve.contract.registration import Registration, parse_registration
from adaserve.engine.engine import StepMetrics
from adaserve.worker.measurements import Measurements


def step(n_decode: int, ms: float, *, n_prefill: int = 0, verified: int = 0, accepted: int = 0) -> StepMetrics:
    return StepMetrics(n_decode=n_decode, n_prefill=n_prefill, tokens_verified=verified, tokens_accepted=accepted,
                       t_step_s=ms / 1e3)


def test_the_curve_has_a_point_per_number_of_requests_in_an_iteration() -> None:
    m = Measurements()
    m.on_step(step(1, 20.0, verified=5, accepted=2))  # one request gained 3 tokens
    m.on_step(step(1, 30.0, verified=5, accepted=0))
    m.on_step(step(1, 40.0, n_prefill=1, verified=4, accepted=1))  # two requests, one prefilling
    m.on_step(step(1, 50.0, n_prefill=1, verified=4, accepted=3))
    m.on_step(step(0, 100.0, n_prefill=2))  # prefill only: in nobody's TPOT, not on the curve
    m.on_step(step(0, 900.0, n_prefill=1))  # a lone request's prompt: its TTFT, not its tokens' pace
    m.on_step(step(0, 5.0))  # nothing ran (never happens): not a point
    got = m.measured().iterations
    assert [(p.requests, p.steps, p.iteration_ms, p.tokens_verified, p.tokens_per_request) for p in got] == [
        (1, 2, pytest.approx(25.0), 5.0, 2.0), (2, 2, pytest.approx(45.0), 4.0, 3.0)]


def test_each_point_says_what_each_class_gained_over_its_own_window() -> None:
    m = Measurements(steps_per_point=2, decodes_per_class=3)
    m.on_step(step(3, 30.0, verified=9, accepted=4), {"a": ("chat", 3), "b": ("chat", 1), "c": ("summ", 0)})
    m.on_step(step(3, 30.0, verified=9, accepted=2), {"a": ("chat", 2), "c": ("summ", 0)})  # "d": class unknown
    (p,) = m.measured().iterations
    assert p.tokens_per_request == pytest.approx(12 / 6)
    got = {c: (t.tokens, t.decodes) for c, t in p.tokens_by_class.items()}
    assert got == {"chat": (pytest.approx(9 / 3), 3), "summ": (1.0, 2)}
    # a burst of chat pushes the oldest iterations out of the point, but not summ's figure
    for _ in range(3):
        m.on_step(step(3, 30.0, verified=9, accepted=3), {"a": ("chat", 0), "b": ("chat", 0), "e": ("chat", 0)})
    (p,) = m.measured().iterations
    assert p.steps == 2 and p.tokens_per_request == pytest.approx(2.0)
    assert {c: (t.tokens, t.decodes) for c, t in p.tokens_by_class.items()} == {"chat": (1.0, 3), "summ": (1.0, 2)}


def test_each_class_says_what_the_iterations_it_was_in_cost() -> None:
    # a lone summary's iterations cost more than a lone chat's: each class keeps its own, one per decode
    m = Measurements(steps_per_point=4, decodes_per_class=4)
    m.on_step(step(1, 30.0), {"a": ("chat", 1)})
    m.on_step(step(1, 50.0), {"b": ("summ", 0)})
    m.on_step(step(1, 70.0), {"b": ("summ", 0)})
    (p,) = m.measured().iterations
    assert p.iteration_ms == pytest.approx(50.0)
    assert {c: t.iteration_ms for c, t in p.tokens_by_class.items()} == {"chat": 30.0, "summ": pytest.approx(60.0)}


def test_each_point_keeps_only_the_recent_iterations() -> None:
    m = Measurements(steps_per_point=3)
    for ms in (100.0, 100.0, 10.0, 20.0, 30.0):
        m.on_step(step(2, ms, verified=2))
    (p,) = m.measured().iterations
    assert (p.requests, p.steps, p.iteration_ms, p.tokens_per_request) == (2, 3, pytest.approx(20.0), 1.0)


def test_classes_over_their_last_finished_requests() -> None:
    m = Measurements(finished_per_class=2)
    m.on_finished("chat", met=False, tpot_ms=90.0, ttft_ms=500.0, accepted=[0, 0])
    m.on_finished("chat", met=True, tpot_ms=30.0, ttft_ms=100.0, accepted=[1, 2, 3])
    m.on_finished("chat", met=True, tpot_ms=None, ttft_ms=50.0, accepted=[])  # one token: no TPOT
    m.on_finished("coding", met=False, tpot_ms=60.0, ttft_ms=None, accepted=[4])
    got = m.measured().classes
    assert got["chat"].model_dump() == {"finished": 2, "met": 2, "attainment": 1.0, "tpot_ms": 30.0, "ttft_ms": 75.0,
                                        "min_ttft_ms": 50.0, "accepted_per_verification": 2.0}
    assert got["coding"].model_dump() == {"finished": 1, "met": 0, "attainment": 0.0, "tpot_ms": 60.0,
                                          "ttft_ms": None, "min_ttft_ms": None, "accepted_per_verification": 4.0}


def test_what_it_publishes_reads_back_as_a_registration() -> None:
    m = Measurements()
    m.on_step(step(3, 45.0, verified=12, accepted=4))
    m.on_finished("chat", met=True, tpot_ms=25.0, ttft_ms=80.0, accepted=[1])
    reg = Registration(worker_id="w", address="http://w", status="ready", measured=m.measured())
    again = parse_registration(reg.document())
    assert again is not None and again.measured == reg.measured and again.measured.iterations[0].requests == 3


def test_feeding_on_one_thread_while_reading_on_another() -> None:
    m = Measurements(steps_per_point=8)
    stop = threading.Event()

    def feed() -> None:
        i = 0
        while not stop.is_set():
            m.on_step(step(1 + i % 4, 10.0 + i % 7, verified=3, accepted=1))
            i += 1

    t = threading.Thread(target=feed)
    t.start()
    try:
        for _ in range(200):
            for p in m.measured().iterations:
                assert 1 <= p.steps <= 8 and 10.0 <= p.iteration_ms <= 16.0
    finally:
        stop.set()
        t.join()


def test_windows_must_hold_something() -> None:
    with pytest.raises(ValueError, match="at least one"):
        Measurements(steps_per_point=0)
