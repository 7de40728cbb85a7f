"""The engine's host time per iteration as a line in (depth, requests) (adaserve/engine/cost/host_cost.py)."""

from __future__ import annotations

import pytest

from adaserve.engine.cost.host_cost import HostCost


def test_nothing_is_predicted_before_a_kind_has_its_samples() -> None:
    h = HostCost(min_samples=4)
    for _ in range(3):
        h.observe(2, 1, 0.003)
        h.observe(0, 1, 0.0005)
    assert h.predict(2, 1) == 0.0 and h.predict(0, 1) == 0.0
    h.observe(2, 1, 0.003)
    assert h.predict(2, 1) == pytest.approx(0.003) and h.predict(0, 1) == 0.0  # plain still unlearnt


def test_a_line_in_depth_and_requests_is_recovered_and_plain_is_its_own() -> None:
    h = HostCost(refit_every=1)
    for i in range(64):
        d, n = 1 + i % 8, 1 + (i * 5) % 7
        h.observe(d, n, 0.001 + 0.0003 * d + 0.0002 * n)
        h.observe(0, n, 0.0004 + 0.00005 * n)
    assert h.predict(4, 3) == pytest.approx(0.001 + 0.0012 + 0.0006)
    assert h.predict(8, 32) == pytest.approx(0.001 + 0.0024 + 0.0064)
    assert h.predict(0, 32) == pytest.approx(0.0004 + 0.0016)


def test_an_axis_the_window_never_varied_stays_flat() -> None:
    """Every iteration at depth 2 and one request: no slope is invented (least squares about the means), so a
    deeper tree is not predicted to cost 3x the host time."""
    h = HostCost()
    for _ in range(20):
        h.observe(2, 1, 0.003)
    assert h.predict(8, 1) == pytest.approx(0.003) and h.predict(2, 16) == pytest.approx(0.003)


def test_slopes_never_fall_and_bad_samples_are_ignored() -> None:
    h = HostCost(refit_every=1)
    for i in range(32):
        d = 1 + i % 4
        h.observe(d, 1, 0.004 - 0.0005 * d)  # noise that runs downhill: read as flat
    assert h.predict(8, 1) == pytest.approx(h.predict(1, 1))
    before = h.predict(2, 1)
    h.observe(2, 0, 1.0)  # no request decoding
    h.observe(2, 1, float("nan"))
    assert h.predict(2, 1) == before


def test_the_window_forgets_old_iterations() -> None:
    h = HostCost(window=16, refit_every=1)
    for _ in range(16):
        h.observe(1, 1, 0.010)
    for _ in range(16):
        h.observe(1, 1, 0.002)
    assert h.predict(1, 1) == pytest.approx(0.002)
