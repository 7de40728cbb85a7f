"""The one SLO rule every service judges by, and the class-name syntax they share."""

from __future__ import annotations

import pytest
from pydantic import TypeAdapter, ValidationError

from adaserve.contract.slo import SloClassName, mean_tpot_ms, slo_met, ttft_ms


@pytest.mark.parametrize(("finish", "ttft", "tpot", "tpot_target", "ttft_target", "met"), [
    ("stop", 100.0, 30.0, 50.0, None, True),
    ("length", 100.0, 30.0, 50.0, None, True),
    ("stop", 100.0, 50.0, 50.0, None, True),  # exactly on target
    ("abort", 100.0, 30.0, 50.0, None, False),  # aborted: never met, however fast
    ("error", 100.0, 30.0, 50.0, None, False),
    (None, 100.0, 30.0, 50.0, None, False),
    ("stop", 100.0, 50.1, 50.0, None, False),  # TPOT above the target
    ("stop", 99_999.0, 30.0, 50.0, None, True),  # no TTFT target: TTFT is not checked
    ("stop", 100.0, None, 50.0, None, True),  # one token: no TPOT to miss
    ("stop", 2000.0, 40.0, 40.0, 2000.0, True),
    ("stop", 2000.1, 30.0, 40.0, 2000.0, False),  # TTFT above its target
    ("stop", None, 30.0, 40.0, 2000.0, True),
    ("length", 100.0, 40.5, 40.0, 2000.0, False),
    ("stop", 100.0, 900.0, None, None, True),  # a worker request without any target: met if it ends normally
    ("stop", 3000.0, 900.0, None, 2000.0, False),  # ... but a TTFT target alone still counts
])
def test_slo_met(finish: str | None, ttft: float | None, tpot: float | None, tpot_target: float | None,
                 ttft_target: float | None, met: bool) -> None:
    assert slo_met(finish, tpot_ms=tpot, ttft_ms=ttft, tpot_target_ms=tpot_target, ttft_target_ms=ttft_target) is met


@pytest.mark.parametrize("name", ["chat", "a", "Coding-2", "x.y_z", "9" * 64])
def test_class_names_accepted(name: str) -> None:
    assert TypeAdapter(SloClassName).validate_python(name) == name


@pytest.mark.parametrize("name", ["", "two words", "-lead", "ü", "9" * 65])
def test_class_names_refused(name: str) -> None:
    with pytest.raises(ValidationError, match="must match"):
        TypeAdapter(SloClassName).validate_python(name)


def test_ttft_and_mean_tpot() -> None:
    assert ttft_ms(10.0, None) is None and ttft_ms(10.0, 10.25) == 250.0
    assert mean_tpot_ms(None, None, 0) is None
    assert mean_tpot_ms(1.0, 1.0, 1) is None  # one token: no time per token
    assert mean_tpot_ms(1.0, 1.3, 4) == pytest.approx(100.0)  # three gaps after the first token
