"""Choosing the budget B from a roofline (adaserve.engine.cost.budget): the knee on clean and noisy curves."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from adaserve.engine.config import EngineConfig
from adaserve.engine.cost.budget import (
    KneeConfig,
    RooflinePoint,
    TableCheck,
    check_roofline,
    choose_budget,
    relative_spread,
    reproducible_dip,
    robust_latency,
    smooth_roofline,
)
from adaserve.engine.speculation.adaptive import AdaptiveConfig, speculation_floor

GRID = [2**i for i in range(11)]  # 1 .. 1024, the profiler's probe sizes
T0 = 0.020  # s: one memory-bound forward
FAST = settings(deadline=None, max_examples=60)


def flat_linear(n: int, knee: int, t0: float = T0) -> float:
    """Ideal roofline: flat while memory-bound (n <= knee), linear in n once compute-bound."""
    return t0 if n <= knee else t0 * n / knee


def curve(lat: list[float], grid: list[int] = GRID) -> list[RooflinePoint]:
    return [RooflinePoint(n, t) for n, t in zip(grid, lat, strict=True)]


def naive_budget(points: list[RooflinePoint], eps: float) -> int:
    """The literal definition on raw data: largest n with t(n) <= (1 + eps) t(1)."""
    ref = min(points, key=lambda p: p.n_tokens).latency_s
    return max(p.n_tokens for p in points if p.latency_s <= (1 + eps) * ref)


pow2_knee = st.integers(0, 10).map(lambda i: 2**i)


# ------------------------------------------------------------------------------------------------
# robust_latency and validation
# ------------------------------------------------------------------------------------------------


def test_robust_latency_is_median_and_ignores_stalls():
    assert robust_latency([3.0, 1.0, 2.0]) == 2.0
    assert robust_latency([0.010] * 7 + [0.5, 0.9]) == pytest.approx(0.010)  # two stalls out of 9


@pytest.mark.parametrize("bad", [[], [1.0, math.nan], [math.inf], [1.0, -0.1]])
def test_robust_latency_rejects(bad):
    with pytest.raises(ValueError):
        robust_latency(bad)


@pytest.mark.parametrize(
    "args", [(0, 1.0), (-1, 1.0), (1, 0.0), (1, -1.0), (1, math.nan), (1, math.inf), (True, 1.0), (1.5, 1.0)]
)
def test_roofline_point_validation(args):
    with pytest.raises(ValueError):
        RooflinePoint(*args)


@pytest.mark.parametrize(
    "kw",
    [{"eps": -0.1}, {"eps": math.nan}, {"eps_max": math.inf}, {"throughput_tol": 1.0},
     {"criterion": "fastest"}, {"smooth": 1}],
)
def test_knee_config_validation(kw):
    with pytest.raises(ValueError):
        KneeConfig(**kw)


def test_choose_budget_input_validation():
    with pytest.raises(ValueError):
        choose_budget([])
    with pytest.raises(ValueError):
        choose_budget([RooflinePoint(1, 1.0), RooflinePoint(1, 1.1)])  # duplicate n
    with pytest.raises(ValueError):
        choose_budget([(1, 1.0)])  # type: ignore[list-item]
    with pytest.raises(ValueError):
        choose_budget(curve([T0] * 11), cfg="latency")  # type: ignore[arg-type]


# ------------------------------------------------------------------------------------------------
# Knee on clean curves
# ------------------------------------------------------------------------------------------------


@given(knee=pow2_knee)
@FAST
def test_clean_flat_then_linear_knee_exact(knee):
    pts = curve([flat_linear(n, knee) for n in GRID])
    assert choose_budget(pts) == knee
    assert choose_budget(pts, KneeConfig(smooth=False)) == knee


@given(knee=st.integers(1, 2000), eps=st.floats(0.0, 0.5))
@FAST
def test_clean_curve_any_knee_matches_definition(knee, eps):
    """Knee off the grid: B is the literal definition, i.e. the largest grid n <= (1+eps) K. Where (1+eps) K is a grid
    n itself (knee 3, eps 1/3: n = 4), t(n) and (1+eps) t(1) are equal in real numbers and their floats decide either
    way: the definition has no single answer there, so such cases are left out."""
    assume(all(abs((1 + eps) * knee - n) > 1e-9 * n for n in GRID))
    pts = curve([flat_linear(n, knee) for n in GRID])
    b = choose_budget(pts, KneeConfig(eps=eps, criterion="latency"))
    assert b == naive_budget(pts, eps) == max(n for n in GRID if n <= (1 + eps) * knee)
    assert b <= 2 * knee and (b == GRID[-1] or 2 * b > knee)  # within one power of two of the knee


@given(
    steps=st.lists(st.floats(0.0, 0.5), min_size=1, max_size=11),
    eps=st.floats(0.0, 1.0),
)
@FAST
def test_monotone_curve_unsmoothed_matches_definition_and_eps_is_monotone(steps, eps):
    lat = list(np.cumsum([T0, *steps[:-1]]) + 0.0)
    pts = curve(lat, GRID[: len(lat)])
    b = choose_budget(pts, KneeConfig(eps=eps, smooth=False, criterion="latency"))
    assert b == naive_budget(pts, eps)
    wider = choose_budget(pts, KneeConfig(eps=eps + 0.1, criterion="latency"))
    assert wider >= choose_budget(pts, KneeConfig(eps=eps, criterion="latency"))


def test_order_of_points_does_not_matter_and_short_grids_work():
    pts = curve([flat_linear(n, 64) for n in GRID])
    assert choose_budget(list(reversed(pts))) == 64
    assert choose_budget([RooflinePoint(1, T0)]) == 1
    assert choose_budget([RooflinePoint(1, T0), RooflinePoint(2, T0)]) == 2
    assert choose_budget([RooflinePoint(1, T0), RooflinePoint(2, 3 * T0)]) == 1
    assert choose_budget(curve([T0, T0, T0], [1, 2, 4])) == 4


def test_smooth_roofline_is_non_decreasing():
    rng = np.random.default_rng(0)
    pts = curve(list(T0 * rng.lognormal(0.0, 0.3, size=len(GRID))))
    lat = [p.latency_s for p in smooth_roofline(pts)]
    assert all(b >= a for a, b in itertools.pairwise(lat))
    assert [p.n_tokens for p in smooth_roofline(pts)] == GRID


# ------------------------------------------------------------------------------------------------
# Knee on noisy curves
# ------------------------------------------------------------------------------------------------


@given(knee=pow2_knee, seed=st.integers(0, 2**32 - 1), sigma=st.floats(0.0, 0.02))
@FAST
def test_multiplicative_noise_knee_exact(knee, seed, sigma):
    rng = np.random.default_rng(seed)
    lat = [flat_linear(n, knee) * rng.lognormal(0.0, sigma) for n in GRID]
    assert choose_budget(curve(lat)) == knee


@given(
    knee_idx=st.integers(2, 10),
    data=st.data(),
    spike=st.floats(1.5, 10.0),
    seed=st.integers(0, 2**32 - 1),
)
@FAST
def test_single_spike_in_flat_region_does_not_end_search(knee_idx, data, spike, seed):
    knee = GRID[knee_idx]
    rng = np.random.default_rng(seed)
    lat = [flat_linear(n, knee) * rng.lognormal(0.0, 0.01) for n in GRID]
    i = data.draw(st.integers(0, knee_idx), label="spike index")
    lat[i] *= spike
    b = choose_budget(curve(lat))
    if i <= knee_idx - 2:
        assert b == knee  # well inside the flat region (n=1 included): voted out entirely
    else:
        assert b in (knee, knee // 2)  # at the knee's edge: one grid step at most


def test_spike_at_small_n_ends_the_naive_search():
    lat = [flat_linear(n, 256) for n in GRID]
    lat[2] *= 1.5  # n = 4
    pts = curve(lat)
    assert choose_budget(pts, KneeConfig(smooth=False)) == 2  # why smoothing is on by default
    assert choose_budget(pts) == 256


@given(
    knee_idx=st.integers(1, 7),  # K = 1 (never flat) has no flat neighbours to vote a dip at n=8 out
    data=st.data(),
    dip=st.floats(0.2, 1.0),
    seed=st.integers(0, 2**32 - 1),
)
@FAST
def test_single_dip_past_knee_does_not_extend_search(knee_idx, data, dip, seed):
    knee = GRID[knee_idx]
    rng = np.random.default_rng(seed)
    lat = [flat_linear(n, knee) * rng.lognormal(0.0, 0.01) for n in GRID]
    i = data.draw(st.integers(knee_idx + 1, len(GRID) - 1), label="dip index")
    lat[i] = T0 * dip  # back under the threshold, however far out
    b = choose_budget(curve(lat))
    if i >= knee_idx + 3:
        assert b == knee
    else:
        assert b in (knee, 2 * knee)


def test_dip_at_large_n_fools_the_literal_definition_only():
    lat = [flat_linear(n, 32) for n in GRID]
    lat[10] = T0  # n = 1024 measured as fast as n = 1
    pts = curve(lat)
    assert naive_budget(pts, 0.1) == 1024
    assert choose_budget(pts, KneeConfig(smooth=False)) == 32  # the monotone envelope alone suffices
    assert choose_budget(pts) == 32


def test_fast_path_at_n1_is_not_the_reference():
    """A special n=1 kernel (e.g. GEMV) 15% faster than the plateau must not collapse B to 1."""
    lat = [flat_linear(n, 128) for n in GRID]
    lat[0] *= 0.85
    pts = curve(lat)
    assert naive_budget(pts, 0.1) == 1
    assert choose_budget(pts) == 128


# ------------------------------------------------------------------------------------------------
# Throughput criterion
# ------------------------------------------------------------------------------------------------


@given(knee=pow2_knee)
@FAST
def test_throughput_criterion_on_ideal_roofline_is_the_ridge(knee):
    pts = curve([flat_linear(n, knee) for n in GRID])
    assert choose_budget(pts, KneeConfig(criterion="throughput")) == knee


def test_throughput_criterion_on_gradual_roofline():
    # t(n) = t0 sqrt(1 + (n/K)^2): tokens/s = n/t keeps rising past the latency knee.
    knee = 128
    pts = curve([T0 * math.sqrt(1 + (n / knee) ** 2) for n in GRID])
    lat_b = choose_budget(pts, KneeConfig(eps=0.1, criterion="latency"))
    thr_b = choose_budget(pts, KneeConfig(criterion="throughput", eps_max=0.5))
    assert lat_b == 32  # sqrt(1 + x^2) <= 1.1  <=>  n <= 0.458 K
    assert thr_b == 128  # sqrt(1 + x^2) <= 1.5  <=>  n <= 1.118 K, tokens/s increasing
    # the latency cap still binds the throughput criterion
    assert choose_budget(pts, KneeConfig(criterion="throughput", eps_max=0.1)) == lat_b


# ---- elasticity (the default criterion) ----------------------------------------------------------
@pytest.mark.parametrize("knee", [1, 4, 32, 156, 512])
def test_elasticity_finds_the_ridge_of_a_flat_then_linear_roofline(knee):
    pts = curve([flat_linear(n, knee) for n in GRID])
    b = choose_budget(pts)
    assert b <= max(knee, 1) * 2 and 2 * b > knee  # the ridge, up to the power-of-two grid


@pytest.mark.parametrize(("fixed_ms", "per_token_ms"), [(9.0, 0.17), (5.0, 0.02), (2.0, 0.5)])
def test_elasticity_on_a_cpu_like_curve_lands_near_fixed_over_per_token(fixed_ms, per_token_ms):
    """t = a + b n has no flat part: the latency criterion says B = 1, elasticity says ~a/b."""
    pts = curve([(fixed_ms + per_token_ms * n) / 1e3 for n in GRID])
    b = choose_budget(pts)
    ratio = fixed_ms / per_token_ms
    assert ratio / 2 <= b <= 2 * ratio or (b == GRID[-1] and ratio > GRID[-1])
    assert choose_budget(pts, KneeConfig(criterion="latency")) < b


def test_elasticity_ignores_noise_and_a_lone_spike():
    rng = np.random.default_rng(3)
    lat = [flat_linear(n, 64) * float(rng.lognormal(0, 0.02)) for n in GRID]
    lat[2] *= 3.0  # one spike in the flat region
    assert choose_budget(curve(lat)) == 64


# ------------------------------------------------------------------------------------------------
# Is the table a roofline at all? And the least B the engine may run with
# ------------------------------------------------------------------------------------------------

GRID256 = [2**i for i in range(9)]  # 1 .. 256, the CPU probe sizes
# measured on this project's machine (docs: issue 14): while busy, then quiet; ms for n = 1, 2, 4, ..., 256
BUSY_MS = [148, 828, 48, 790, 956, 93, 412, 1204, 556]
QUIET_MS = [6.9, 9.1, 12.3, 15.3, 23.4, 23.6, 28.9, 33.3, 49.0]


def table_ms(ms: list[float]) -> list[RooflinePoint]:
    return curve([t / 1e3 for t in ms], GRID256)


def test_busy_table_fails_the_check_and_says_why():
    verdict = check_roofline(table_ms(BUSY_MS))
    assert not verdict.ok
    text = " ".join(verdict.problems)
    assert "t(n=4) = 48.0 ms is 94% below t(n=2) = 828.0 ms" in text  # the drop
    assert "t(n=2) = 828.0 ms is 5.6x t(n=1) = 148.0 ms" in text  # the impossible rise
    assert choose_budget(table_ms(BUSY_MS)) == 2  # what the busy machine's knee was: why the check exists
    assert verdict.reason(limit=2).endswith(f"and {len(verdict.problems) - 2} more")


def test_quiet_table_passes_the_check():
    verdict = check_roofline(table_ms(QUIET_MS))
    assert verdict.ok and verdict.reason() == "ok"
    assert choose_budget(table_ms(QUIET_MS)) == 8


@pytest.mark.parametrize("knee", [1, 16, 128, 1024])
def test_clean_rooflines_pass_the_check(knee):
    assert check_roofline(curve([flat_linear(n, knee) for n in GRID])).ok  # GPU: flat then linear
    assert check_roofline(curve([T0 + 1e-4 * n for n in GRID])).ok  # CPU: a + b n


def test_check_tolerates_small_wobbles_but_not_drops_or_jumps():
    flat = [T0] * len(GRID)
    wobble = [T0 * (1 + 0.05 * (-1) ** i) for i in range(len(GRID))]  # +-5%: a quiet machine
    assert check_roofline(curve(flat)).ok and check_roofline(curve(wobble)).ok
    drop = list(flat)
    drop[6] = 0.7 * T0  # 30% cheaper with more tokens
    assert [p.startswith("t(n=64)") for p in check_roofline(curve(drop)).problems] == [True]
    jump = [flat_linear(n, 16) for n in GRID]
    jump[5:] = [4 * t for t in jump[5:]]  # 8x per doubling at n=32, then a clean doubling again
    assert [p.startswith("t(n=32)") for p in check_roofline(curve(jump)).problems] == [True]
    # below the noise floor, ratios do not count: a 0.05 ms forward may read 0.15 ms
    tiny = [5e-5] * len(GRID)
    tiny[3] = 1.5e-4
    assert check_roofline(curve(tiny)).ok
    assert not check_roofline(curve(tiny), check=TableCheck(noise_floor_s=0.0)).ok


def test_check_reads_the_spread_of_the_rounds():
    pts = curve([flat_linear(n, 64) for n in GRID])
    agree = {n: [T0, T0 * 1.02, T0 * 0.99, T0 * 5.0, T0] for n in GRID}  # one stall per probe: ignored
    assert check_roofline(pts, agree).ok
    agree[4] = [T0, 9 * T0, T0, 7 * T0, T0]  # two stalls of five: the median is still right
    assert check_roofline(pts, agree).ok
    disagree = dict(agree)
    disagree[8] = [T0, 2 * T0, 3 * T0, 0.5 * T0, 4 * T0]  # most rounds far from each other
    problems = check_roofline(pts, disagree).problems
    assert len(problems) == 1 and problems[0].startswith("t(n=8) rounds disagree")
    assert relative_spread([1.0, 1.0, 1.0]) == 0.0
    assert relative_spread([1.0, 2.0, 3.0]) == pytest.approx(1.0 / 2.0)  # MAD 1 around median 2


# this CPU at context 64 (issue 14): t(n=2) reproducibly ~30% below t(n=1), a faster kernel for two rows
DIP_MS = [9.0, 6.3, 7.0, 8.1, 10.2, 14.0, 21.5, 35.0, 62.0]
JITTER = [1.00, 1.03, 0.98, 1.02, 0.99]  # five rounds of a quiet machine


def dip_rounds(ms: list[float]) -> dict[int, list[float]]:
    return {n: [t / 1e3 * j for j in JITTER] for n, t in zip(GRID256, ms, strict=True)}


def test_a_dip_every_round_shows_among_few_rows_is_a_kernel_not_noise():
    """Issue 14: the quiet machine's table was refused (and never cached) for a reproducible dip at n=2."""
    pts = table_ms(DIP_MS)
    assert not check_roofline(pts).ok  # without the rounds, a 30% drop is refused as before
    assert check_roofline(pts, dip_rounds(DIP_MS)).ok  # with them: every round shows it
    assert choose_budget(pts) >= 8  # the slow n=1 is voted out of the knee (Tukey's end rule)


def test_a_dip_the_rounds_do_not_agree_on_is_still_refused():
    rounds = dip_rounds(DIP_MS)
    rounds[2] = [6.3e-3, 9.5e-3, 6.2e-3, 9.6e-3, 6.4e-3]  # n=2 cheaper than n=1 in 3 rounds of 5 only
    rounds[1] = [9.0e-3, 9.0e-3, 9.0e-3, 9.0e-3, 9.0e-3]
    problems = check_roofline(table_ms(DIP_MS), rounds).problems
    assert any(p.startswith("t(n=2)") and "below t(n=1)" in p for p in problems)
    assert reproducible_dip([1, 1, 1, 1, 2], [2, 2, 2, 2, 1])  # one stall in five is allowed
    assert not reproducible_dip([1, 1, 1, 2, 2], [2, 2, 2, 1, 1])
    assert not reproducible_dip([1, 1], [2, 2])  # two rounds cannot show a dip repeats


def test_a_reproducible_dip_past_few_rows_or_too_deep_is_still_refused():
    """A deterministic replay is reproducible by construction: only where kernels are chosen per row
    count, and no deeper than max_dip, does reproducibility excuse a drop."""
    late = list(QUIET_MS)
    late[6] = 0.7 * late[5]  # n=64 30% below n=32, in every round
    problems = check_roofline(table_ms(late), dip_rounds(late)).problems
    assert [p.startswith("t(n=64)") for p in problems] == [True]
    deep = list(DIP_MS)
    deep[1] = 0.4 * deep[0]  # 60% below: not a kernel choice
    assert not check_roofline(table_ms(deep), dip_rounds(deep)).ok
    assert check_roofline(table_ms(deep), dip_rounds(deep), TableCheck(max_dip=0.7)).ok
    assert not check_roofline(table_ms(DIP_MS), dip_rounds(DIP_MS), TableCheck(dip_tokens=1)).ok


def test_the_busy_table_fails_even_with_identical_rounds():
    verdict = check_roofline(table_ms(BUSY_MS), dip_rounds(BUSY_MS))
    assert any("below" in p for p in verdict.problems) and any("is physical" in p for p in verdict.problems)


@pytest.mark.parametrize("kw", [{"max_drop": 1.0}, {"max_drop": -0.1}, {"max_exponent": 0.9},
                                {"max_spread": math.nan}, {"noise_floor_s": -1.0}, {"max_dip": 1.0},
                                {"dip_tokens": -1}])
def test_table_check_validation(kw):
    with pytest.raises(ValueError):
        TableCheck(**kw)


def test_speculation_floor_covers_one_full_tree_and_eq8_depth():
    a = EngineConfig().adaptive
    floor = speculation_floor()
    assert floor == speculation_floor(a) == max(1 + a.d_max * a.w_max, (a.d_max + 1) * (1 + a.c1))
    assert floor >= 1 + a.d_max * a.w_max  # the largest tree one request verifies
    # Eq. 8 with B1 = floor gives a lone request the full depth
    assert floor // (1 + a.c1) - 1 >= a.d_max
    assert speculation_floor(AdaptiveConfig(d_max=8, w_max=4)) == 33
    assert speculation_floor(AdaptiveConfig(d_max=2, w_max=1, c1=3)) == 12  # (2 + 1) * (1 + 3)
    # the busy table's knee is below it; the quiet one's too on this CPU (8 < 10)
    assert choose_budget(table_ms(BUSY_MS)) < floor and choose_budget(table_ms(QUIET_MS)) < floor
