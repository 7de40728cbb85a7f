"""Eq. 8-9: speculation depth and width from the number of active requests."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from adaserve.engine.adaptive import depth_width
from adaserve.engine.config import AdaptiveConfig


def test_defaults_low_and_high_load():
    cfg = AdaptiveConfig()
    assert depth_width(1, cfg) == (cfg.d_max, cfg.w_max)  # idle: deepest, widest
    assert depth_width(0, cfg) == depth_width(1, cfg)  # nothing running: no division by zero
    assert depth_width(10_000, cfg) == (cfg.d_min, 1)  # saturated: shallowest chain


def test_formula_by_hand():
    cfg = AdaptiveConfig(d_min=1, d_max=8, w_max=4, b1=128, b2=32, c1=1, c2=0)
    # n = 16: d = floor(128 / 17) - 1 = 6, w = floor(32 / 16) + 0 = 2
    assert depth_width(16, cfg) == (6, 2)
    # n = 32: d = floor(128 / 33) - 1 = 2, w = 1
    assert depth_width(32, cfg) == (2, 1)
    # c2 widens every batch by a constant; c1 = 0 works for n = 0 too
    assert depth_width(16, AdaptiveConfig(d_max=8, w_max=4, b2=32, c2=1)) == (6, 3)
    assert depth_width(0, AdaptiveConfig(d_max=8, w_max=4, c1=0)) == (8, 4)


configs = st.builds(
    lambda d_min, extra, w_max, b1, b2, c1, c2: AdaptiveConfig(
        d_min=d_min, d_max=d_min + extra, w_max=w_max, b1=b1, b2=b2, c1=c1, c2=c2),
    st.integers(0, 4), st.integers(0, 8), st.integers(1, 8), st.integers(1, 1024), st.integers(1, 512),
    st.integers(0, 8), st.integers(-2, 4),
)


@settings(max_examples=100, deadline=None)
@given(configs, st.integers(0, 2000))
def test_bounds_formula_and_monotone(cfg: AdaptiveConfig, n: int):
    d, w = depth_width(n, cfg)
    assert cfg.d_min <= d <= cfg.d_max
    assert 1 <= w <= cfg.w_max
    m = max(n, 1)
    assert d == min(max(cfg.b1 // (m + cfg.c1) - 1, cfg.d_min), cfg.d_max)
    assert w == min(max(cfg.b2 // m + cfg.c2, 1), cfg.w_max)
    d2, w2 = depth_width(n + 1, cfg)  # more requests never deepen or widen the trees
    assert d2 <= d and w2 <= w


@pytest.mark.parametrize("kwargs", [
    {"d_min": -1}, {"d_min": 5, "d_max": 4}, {"w_max": 0}, {"b1": 0}, {"b2": 0}, {"c1": -1},
])
def test_config_validates(kwargs: dict):
    with pytest.raises(ValueError):
        AdaptiveConfig(**kwargs)


def test_negative_n_rejected():
    with pytest.raises(ValueError):
        depth_width(-1, AdaptiveConfig())
