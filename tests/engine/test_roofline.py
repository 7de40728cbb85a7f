"""Start-up profiler logic: budget knee, cost-model fit, profile cache (adaserve.engine.roofline)."""

from __future__ import annotations

import itertools
import json
import logging
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from adaserve.engine.roofline import (
    CACHE_DIR_ENV,
    CostModel,
    FitReport,
    KneeConfig,
    ProfileCache,
    ProfileKey,
    RooflinePoint,
    choose_budget,
    default_cache_dir,
    fit_cost_model,
    robust_latency,
    smooth_roofline,
)

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
    """Knee off the grid: B is the literal definition, i.e. the largest grid n <= (1+eps) K."""
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


# ------------------------------------------------------------------------------------------------
# Cost model
# ------------------------------------------------------------------------------------------------

ALPHA, GAMMA, DELTA = 2.0e-7, 3.0e-5, 8.0e-3  # s/context token, s/batched token, s


def synth_samples(rng: np.random.Generator, n: int, sigma: float) -> list[tuple[int, int, float]]:
    out = []
    for _ in range(n):
        c = int(rng.integers(0, 200_000))
        b = int(rng.integers(1, 1025))
        out.append((c, b, (ALPHA * c + GAMMA * b + DELTA) * float(rng.lognormal(0.0, sigma))))
    return out


def test_cost_model_exact_recovery_without_noise():
    model, rep = fit_cost_model(synth_samples(np.random.default_rng(1), 20, 0.0))
    assert model.alpha == pytest.approx(ALPHA, rel=1e-9)
    assert model.gamma == pytest.approx(GAMMA, rel=1e-9)
    assert model.delta == pytest.approx(DELTA, rel=1e-9)
    assert rep.max_rel_error < 1e-9 and rep.r2 == pytest.approx(1.0)
    assert rep.n_samples == 20


@given(seed=st.integers(0, 2**32 - 1), weighting=st.sampled_from(["relative", "absolute"]))
@settings(deadline=None, max_examples=25)
def test_cost_model_recovers_coefficients_from_noisy_samples(seed, weighting):
    samples = synth_samples(np.random.default_rng(seed), 200, 0.02)
    model, rep = fit_cost_model(samples, weighting=weighting)
    assert model.alpha == pytest.approx(ALPHA, rel=0.10)
    assert model.gamma == pytest.approx(GAMMA, rel=0.10)
    assert model.delta == pytest.approx(DELTA, rel=0.10)
    assert rep.mean_rel_error < 0.03
    assert rep.max_rel_error < 0.15
    assert rep.r2 > 0.95


def test_cost_model_coefficients_clamped_non_negative():
    # Data whose unconstrained LS slope in n_context is negative: NNLS pins alpha to 0.
    rng = np.random.default_rng(3)
    samples = [(int(c), int(b), 0.01 - 1e-9 * c + 1e-5 * b) for c, b in
               zip(rng.integers(0, 100_000, 40), rng.integers(1, 512, 40), strict=True)]
    model, _ = fit_cost_model(samples, weighting="absolute")
    assert model.alpha == 0.0
    assert model.gamma > 0 and model.delta > 0


@given(seed=st.integers(0, 2**32 - 1))
@settings(deadline=None, max_examples=25)
def test_cost_model_matches_scipy_nnls(seed):
    nnls = pytest.importorskip("scipy.optimize").nnls
    rng = np.random.default_rng(seed)
    c, b = rng.integers(0, 50_000, 15), rng.integers(1, 512, 15)
    y = np.abs(rng.normal(0.0, 1.0, 3)) @ np.stack([c / 5e4, b / 512, np.ones(15)]) * 0.01
    y = y + rng.normal(0.0, 0.004, 15)
    y = np.abs(y) + 1e-4  # arbitrary positive targets, some trending downwards
    samples = [(int(ci), int(bi), float(yi)) for ci, bi, yi in zip(c, b, y, strict=True)]
    model, _ = fit_cost_model(samples, weighting="absolute")
    design = np.column_stack([c / 5e4, b / 512, np.ones(15)])
    ref, ref_res = nnls(design, y)
    ours = np.array([model.alpha * 5e4, model.gamma * 512, model.delta])
    ours_res = float(np.linalg.norm(design @ ours - y))
    assert ours_res <= ref_res * (1 + 1e-7) + 1e-12
    np.testing.assert_allclose(ours, ref, rtol=1e-5, atol=1e-9)


@pytest.mark.parametrize(
    "samples",
    [
        [(0, 1, 1.0), (1, 2, 1.0)],  # too few
        [(100, b, 0.01 + b * 1e-5) for b in range(1, 10)],  # constant context: alpha vs delta unidentifiable
        [(c, 8, 0.01 + c * 1e-7) for c in range(0, 10_000, 1000)],  # constant batch
        [(c, 2 * c + 1, 0.01) for c in range(10)],  # collinear
        [(0, 1, 1.0), (1, 2, 1.0), (2, 5, -1.0)],  # negative time
        [(0, 1, 1.0), (1, 2, 1.0), (2, 5, math.nan)],
        [(0, 1, 1.0), (1, 2, 1.0), (-2, 5, 1.0)],
        [(0, 1, 1.0), (1, 2, 1.0), (2.5, 5, 1.0)],
        [(0, 1, 1.0), (1, 2, 1.0), (2, 5)],
    ],
)
def test_fit_cost_model_rejects(samples):
    with pytest.raises(ValueError):
        fit_cost_model(samples)


def test_fit_cost_model_rejects_bad_weighting():
    with pytest.raises(ValueError):
        fit_cost_model(synth_samples(np.random.default_rng(0), 10, 0.0), weighting="l1")  # type: ignore[arg-type]


def test_cost_model_predict_and_dict_round_trip():
    m = CostModel(alpha=ALPHA, gamma=GAMMA, delta=DELTA)
    assert m.predict(10_000, 64) == pytest.approx(ALPHA * 10_000 + GAMMA * 64 + DELTA)
    assert m.predict(0, 0) == DELTA
    assert CostModel.from_dict(json.loads(json.dumps(m.to_dict()))) == m
    with pytest.raises(ValueError):
        m.predict(-1, 3)
    with pytest.raises(ValueError):
        CostModel.from_dict({"alpha": 1.0, "gamma": 1.0})
    with pytest.raises(ValueError):
        CostModel.from_dict({"alpha": -1.0, "gamma": 1.0, "delta": 0.0})
    with pytest.raises(ValueError):
        CostModel.from_dict({"alpha": "1", "gamma": 1.0, "delta": 0.0})
    with pytest.raises(ValueError):
        CostModel(alpha=math.nan, gamma=0.0, delta=0.0)
    rep = FitReport(n_samples=3, mean_rel_error=0.01, max_rel_error=0.02, r2=0.99)
    assert json.loads(json.dumps(rep.to_dict())) == rep.to_dict()


# ------------------------------------------------------------------------------------------------
# Profile cache
# ------------------------------------------------------------------------------------------------

KEY = ProfileKey(device="NVIDIA H100 80GB HBM3", model="llama-3.1-8b@3f2a9c", dtype="bfloat16",
                 engine_version="0.1.0")


def profile_data() -> dict:
    model, rep = fit_cost_model(synth_samples(np.random.default_rng(0), 20, 0.01))
    return {"budget": 512, "cost_model": model.to_dict(), "fit": rep.to_dict()}


def test_cache_round_trip(tmp_path):
    cache = ProfileCache(tmp_path / "profiles")
    assert cache.load(KEY) is None  # directory does not exist yet: a miss, not an error
    data = profile_data()
    path = cache.save(KEY, data)
    assert path.parent == tmp_path / "profiles" and path.name == f"{KEY.digest()}.json"
    got = cache.load(KEY)
    assert got == data
    assert CostModel.from_dict(got["cost_model"]).to_dict() == data["cost_model"]
    cache.save(KEY, {"budget": 256})  # overwrite in place
    assert cache.load(KEY) == {"budget": 256}
    assert [p.name for p in (tmp_path / "profiles").iterdir()] == [path.name]  # no temp files left


@pytest.mark.parametrize("field", ["device", "model", "dtype", "engine_version"])
def test_cache_key_separation(tmp_path, field):
    cache = ProfileCache(tmp_path)
    cache.save(KEY, {"budget": 512})
    other = ProfileKey(**{**KEY.to_dict(), field: "something else"})
    assert other.digest() != KEY.digest()
    assert cache.load(other) is None
    assert cache.load(ProfileKey(**KEY.to_dict())) == {"budget": 512}  # equal key, same file


@pytest.mark.parametrize(
    "content", ["", "{not json", '{"format": 1, "key": ', "[1, 2]", '{"format": 99, "data": {}}', "\udcff"]
)
def test_corrupt_cache_file_is_a_miss(tmp_path, caplog, content):
    cache = ProfileCache(tmp_path)
    path = cache.save(KEY, {"budget": 512})
    path.write_bytes(content.encode("utf-8", "surrogateescape"))
    with caplog.at_level(logging.WARNING, logger="adaserve.engine.roofline"):
        assert cache.load(KEY) is None
    assert caplog.records
    cache.save(KEY, {"budget": 128})  # a later save repairs it
    assert cache.load(KEY) == {"budget": 128}


def test_cache_file_of_another_key_is_a_miss(tmp_path, caplog):
    cache = ProfileCache(tmp_path)
    other = ProfileKey(**{**KEY.to_dict(), "device": "NVIDIA A100-SXM4-80GB"})
    cache.save(other, {"budget": 156})
    cache.path_for(other).replace(cache.path_for(KEY))  # e.g. a file copied under the wrong name
    with caplog.at_level(logging.WARNING, logger="adaserve.engine.roofline"):
        assert cache.load(KEY) is None
    assert caplog.records


def test_cache_save_rejects_non_json(tmp_path):
    cache = ProfileCache(tmp_path)
    with pytest.raises(ValueError):
        cache.save(KEY, {"budget": math.nan})
    with pytest.raises(ValueError):
        cache.save(KEY, {"budget": object()})
    with pytest.raises(ValueError):
        cache.save(KEY, [1, 2])  # type: ignore[arg-type]
    assert list(tmp_path.iterdir()) == []  # nothing half-written


def test_profile_key_validation_and_digest():
    with pytest.raises(ValueError):
        ProfileKey(device="", model="m", dtype="bf16", engine_version="1")
    with pytest.raises(ValueError):
        ProfileKey(device="d", model="m", dtype=None, engine_version="1")  # type: ignore[arg-type]
    d = KEY.digest()
    assert d == ProfileKey(**KEY.to_dict()).digest() and len(d) == 32 and int(d, 16) >= 0


def test_default_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path / "x"))
    assert default_cache_dir() == tmp_path / "x"
    assert ProfileCache().dir == tmp_path / "x"
    monkeypatch.delenv(CACHE_DIR_ENV)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert default_cache_dir() == tmp_path / ".cache" / "adaserve" / "profiles"


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
