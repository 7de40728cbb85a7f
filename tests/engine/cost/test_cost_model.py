"""Fitting the forward-cost model (adaserve.engine.cost.cost_model): recovery, constraints, validation."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from adaserve.engine.cost.cost_model import (
    CostModel,
    FitReport,
    _nnls_enumerated,
    _nnls_small,
    _rank,
    even_cells,
    fit_cost_model,
    fit_model,
)
from adaserve.engine.cost.profiler import probe_split
from adaserve.engine.model.runner import chunk_cells

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


@pytest.mark.parametrize("zeros", [0, 1, 2, 4])
@pytest.mark.parametrize("seed", range(15))
def test_nnls_small_is_scipys_nnls_and_the_enumerations(seed, zeros):
    """The shortcuts (the full support's positive solution; the first positive support meeting KKT) give what
    scipy's NNLS and the enumeration of every support give, with 0, 1, 2 or all 4 coefficients at the bound."""
    nnls = pytest.importorskip("scipy.optimize").nnls
    rng = np.random.default_rng(seed)
    a = rng.uniform(0.0, 1.0, (24, 4))
    x_true = rng.uniform(0.2, 1.0, 4)
    x_true[rng.permutation(4)[:zeros]] = -rng.uniform(0.5, 1.0, zeros)  # pushed below the bound
    b = a @ x_true + rng.normal(0.0, 0.01, 24)
    ours, rank = _nnls_small(a, b)
    assert rank == 4
    ref, _ = nnls(a, b)
    np.testing.assert_allclose(ours, ref, rtol=1e-6, atol=1e-9)
    np.testing.assert_allclose(ours, _nnls_enumerated(a, b), rtol=1e-9, atol=1e-12)
    assert np.all(ours >= 0)
    if zeros == 0:  # the full support's solution, as lstsq gives it
        np.testing.assert_array_equal(ours, np.linalg.lstsq(a, b, rcond=None)[0])


def test_nnls_small_leaves_a_rank_deficient_problem_to_the_enumeration():
    """Two equal columns: every split of their weight fits as well; which one is returned is the enumeration's
    choice, not a shortcut's."""
    rng = np.random.default_rng(3)
    col = rng.uniform(0.0, 1.0, 20)
    a = np.column_stack([col, col, rng.uniform(0.0, 1.0, 20)])
    b = a @ np.array([0.5, 0.5, 0.3])
    x, rank = _nnls_small(a, b)
    assert rank == 2
    np.testing.assert_array_equal(x, _nnls_enumerated(a, b))
    assert x[0] + x[1] == pytest.approx(1.0) and x[2] == pytest.approx(0.3)


def _counting_lstsq(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Count ``np.linalg.lstsq`` calls (each an SVD: what a refit's host time is made of)."""
    calls: list[int] = []
    real = np.linalg.lstsq

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(np.linalg, "lstsq", counting)
    return calls


@pytest.mark.parametrize("zeros", [1, 2, 3])
@pytest.mark.parametrize("seed", range(10))
def test_a_hinted_support_is_tried_first_and_changes_no_bit(seed, zeros, monkeypatch):
    """``first`` (the online model's last fit's support) is solved before the ordered search: the right one ends it
    after two solves (the full support's and its own), and any hint, right, wrong, empty or whole, gives the bits the
    search gives without one."""
    rng = np.random.default_rng(100 + seed)
    a = rng.uniform(0.0, 1.0, (24, 4))
    x_true = rng.uniform(0.2, 1.0, 4)
    x_true[rng.permutation(4)[:zeros]] = -rng.uniform(0.5, 1.0, zeros)
    b = a @ x_true + rng.normal(0.0, 0.01, 24)
    plain, _ = _nnls_small(a, b)
    right = [j for j in range(4) if plain[j] > 0]
    for hint in (right, [j for j in range(4) if j not in right], [], [0, 1, 2, 3]):
        np.testing.assert_array_equal(_nnls_small(a, b, first=hint)[0], plain)
    calls = _counting_lstsq(monkeypatch)
    if right:
        _nnls_small(a, b, first=right)
        assert len(calls) == 2


def test_an_online_refit_starts_from_the_last_models_terms(monkeypatch):
    """``fit_model(last=...)``: the model it replaces names the first support tried; the same model as without, in
    fewer solves over windows like the draft's (its context term often at the bound)."""
    rng = np.random.default_rng(5)
    with_hint = without = 0
    for _ in range(30):
        n = 64
        bat = rng.integers(1, 10, n).astype(float)
        ctx = rng.integers(100, 400, n).astype(float)
        cells = ctx * bat + bat * (bat + 1) / 2
        y = (0.5e-3 + 2e-5 * bat) * rng.lognormal(0.0, 0.05, n)  # no context cost: alpha and beta at 0
        calls = _counting_lstsq(monkeypatch)
        prev = fit_model(ctx, bat, y, cells=cells, akaike=False)
        without += len(calls)
        calls.clear()
        again = fit_model(ctx, bat, y, cells=cells, akaike=False, last=prev)
        with_hint += len(calls)
        monkeypatch.undo()
        assert again == prev
    assert with_hint < without


def test_a_window_whose_cells_add_no_rank_is_fitted_without_them_unenumerated(monkeypatch):
    """Cells that follow the other columns (here twice the context) add no rank: the fit is the straight one, read
    from the rank before any non-negative solve (the enumeration of every support it took was thrown away)."""
    import adaserve.engine.cost.cost_model as cm

    rng = np.random.default_rng(8)
    ctx = rng.integers(100, 4000, 40).astype(float)
    bat = rng.integers(1, 64, 40).astype(float)
    y = (ALPHA * ctx + GAMMA * bat + DELTA) * rng.lognormal(0.0, 0.02, 40)
    straight = fit_model(ctx, bat, y)

    def refused(*_args, **_kwargs):
        raise AssertionError("a rank-deficient window's supports were enumerated")

    monkeypatch.setattr(cm, "_nnls_enumerated", refused)
    assert fit_model(ctx, bat, y, cells=2.0 * ctx) == straight
    assert fit_model(ctx, bat, y, cells=2.0 * ctx, akaike=False) == straight


@pytest.mark.parametrize(("case", "rank"), [("full", 4), ("copied", 3), ("tiny", 3), ("small", 4)])
def test_rank_is_numpys_matrix_rank(case: str, rank: int):
    """Full rank; a column twice another's; a column below the numerical threshold (1e-18 of the others); one small
    but above it (1e-9)."""
    m = np.random.default_rng(4).normal(size=(20, 4))
    if case == "copied":
        m[:, 2] = 2.0 * m[:, 1]
    elif case in ("tiny", "small"):
        m[:, 3] *= 1e-18 if case == "tiny" else 1e-9
    assert _rank(m) == np.linalg.matrix_rank(m) == rank


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


# ---- bent at the knee: a roofline, flat while weights dominate, then linear in compute ----------------

KNEE, ABOVE = 128, 2.0e-4  # tokens; extra s per batched token past the knee


def roofline_samples() -> list[tuple[int, int, float]]:
    sizes = [1, 2, 4, 8, 16, 32, 64, 96, 128, 192, 256, 384, 512, 768, 1024]
    return [(min(b, 8) * c, b, ALPHA * min(b, 8) * c + GAMMA * b + DELTA + ABOVE * max(0, b - KNEE))
            for c in (128, 512, 2048) for b in sizes]


def test_a_hinge_at_the_knee_recovers_a_roofline_exactly():
    model, rep = fit_cost_model(roofline_samples(), knee=KNEE)
    assert (model.knee, model.gamma_above) == (KNEE, pytest.approx(ABOVE, rel=1e-6))
    assert (model.alpha, model.gamma, model.delta) == (pytest.approx(ALPHA, rel=1e-6), pytest.approx(GAMMA, rel=1e-6),
                                                       pytest.approx(DELTA, rel=1e-6))
    assert rep.max_rel_error < 1e-6


def test_a_straight_line_misses_the_roofline_that_the_hinge_follows():
    line, line_rep = fit_cost_model(roofline_samples())
    bent, bent_rep = fit_cost_model(roofline_samples(), knee=KNEE)
    assert line.gamma_above == 0 and line.knee == 0
    assert line_rep.max_rel_error > 0.2 > 100 * bent_rep.max_rel_error
    # at the knee the line over-predicts, which is what made the engine shy of the free tokens
    assert line.predict(8 * 512, KNEE) > 1.1 * bent.predict(8 * 512, KNEE)


def test_no_samples_past_the_knee_fit_a_straight_line():
    below = [s for s in roofline_samples() if s[1] <= KNEE]
    model, _ = fit_cost_model(below, knee=KNEE)
    assert (model.gamma_above, model.knee) == (0.0, 0)


def test_a_bent_model_scales_and_round_trips_and_a_straight_one_keeps_three_keys():
    m = CostModel(alpha=ALPHA, gamma=GAMMA, delta=DELTA, gamma_above=ABOVE, knee=KNEE)
    assert m.predict(0, KNEE + 10) == pytest.approx(GAMMA * (KNEE + 10) + DELTA + ABOVE * 10)
    assert m.scaled(2.0).predict(100, 300) == pytest.approx(2.0 * m.predict(100, 300))
    assert CostModel.from_dict(json.loads(json.dumps(m.to_dict()))) == m
    assert set(CostModel(alpha=ALPHA, gamma=GAMMA, delta=DELTA).to_dict()) == {"alpha", "gamma", "delta"}
    with pytest.raises(ValueError):
        CostModel(alpha=0.0, gamma=0.0, delta=0.0, gamma_above=-1.0, knee=4)
    with pytest.raises(ValueError):
        CostModel(alpha=0.0, gamma=0.0, delta=0.0, knee=-1)


# ---- the attention cells: a CPU reads each sequence's keys once per new token -------------------------------

BETA = 3.0e-7  # s per attention cell (a new token times its sequence's context)


def probe_samples(beta: float = BETA) -> list[tuple[int, int, float, int]]:
    """The profiler's probes: n tokens over min(n, 8) sequences of c cached tokens each, priced by a model with
    cells: N_context = min(n, 8) * c, N_cells the sequences' chains over their c (runner.chunk_cells)."""
    sizes = [1, 2, 4, 8, 16, 32, 64, 128, 256]
    cells = {(n, c): sum(chunk_cells(k, c) for k in probe_split(n)) for c in (64, 256) for n in sizes}
    return [(min(n, 8) * c, n, ALPHA * min(n, 8) * c + beta * cells[n, c] + GAMMA * n + DELTA, cells[n, c])
            for c in (64, 256) for n in sizes]


def test_the_profilers_probes_separate_the_cells_from_the_context_read():
    model, rep = fit_cost_model(probe_samples())
    assert (model.alpha, model.beta, model.gamma, model.delta) == (
        pytest.approx(ALPHA, rel=1e-6), pytest.approx(BETA, rel=1e-6), pytest.approx(GAMMA, rel=1e-6),
        pytest.approx(DELTA, rel=1e-6))
    assert rep.max_rel_error < 1e-6
    # 32 one-token rows over 512 cached tokens each: one new token a sequence, so the cells are the context and
    # each token's own key
    truth = ALPHA * 32 * 512 + BETA * (32 * 512 + 32) + GAMMA * 32 + DELTA
    assert model.predict(32 * 512, 32) == pytest.approx(truth, rel=1e-6)
    # SmartSpec's model on the same probes puts the large probes' cells into alpha: 32 such rows over-predicted
    smartspec, _ = fit_cost_model([(c, n, y) for c, n, y, _ in probe_samples()])
    assert smartspec.beta == 0.0
    assert smartspec.predict(32 * 512, 32) > 1.2 * truth


@pytest.mark.parametrize("rows", [1, 3])
def test_cells_that_follow_the_context_leave_smartspecs_model(rows: int):
    """One new token a sequence (cells = context), or the same number in every sample (cells = rows x context):
    nothing tells beta from alpha, so beta is 0 and the fit is SmartSpec's on the context alone."""
    samples = synth_samples(np.random.default_rng(4), 30, 0.01)
    with_cells, _ = fit_cost_model([(c, b, y, rows * c) for c, b, y in samples])
    without, _ = fit_cost_model(samples)
    assert with_cells.beta == 0.0
    assert with_cells == without


def test_a_model_with_cells_predicts_scales_and_round_trips():
    m = CostModel(alpha=ALPHA, gamma=GAMMA, delta=DELTA, beta=BETA)
    assert m.predict(1000, 8, 4000) == pytest.approx(ALPHA * 1000 + GAMMA * 8 + DELTA + BETA * 4000)
    assert m.predict(1000, 8) == pytest.approx(m.predict(1000, 8, 1008))  # default: one new token a sequence
    assert m.scaled(2.0).predict(100, 30, 900) == pytest.approx(2.0 * m.predict(100, 30, 900))
    assert m.to_dict()["beta"] == BETA
    assert CostModel.from_dict(json.loads(json.dumps(m.to_dict()))) == m
    with pytest.raises(ValueError):
        CostModel(alpha=0.0, gamma=0.0, delta=0.0, beta=-1.0)
    for bad in (-1, math.nan, "9"):
        with pytest.raises(ValueError):
            fit_cost_model([(0, 1, 1.0, 0), (1, 2, 1.0, 2), (2, 5, 1.0, bad)])


def test_beta_is_kept_where_it_earns_its_parameter():
    """Akaike's rule: on probes timed with 5% noise, a forward without cells gets a spurious beta rarely (a noisy
    table could otherwise trade gamma for beta), one with cells gets its beta every time."""
    sizes = [1, 2, 4, 8, 16, 32, 64, 128, 256]
    spurious = kept = 0
    for seed in range(50):
        rng = np.random.default_rng(seed)
        for beta in (0.0, BETA):
            samples = [(min(n, 8) * c, n, (ALPHA * min(n, 8) * c + beta * n * c + GAMMA * n + DELTA)
                        * float(rng.lognormal(0.0, 0.05)), n * c) for c in (64, 256) for n in sizes]
            model, _ = fit_cost_model(samples)
            if beta == 0.0:
                spurious += model.beta > 0
                if model.beta == 0:  # dropped: the fit is SmartSpec's on the same samples
                    assert model == fit_cost_model([x[:3] for x in samples])[0]
            else:
                kept += model.beta > 0
    assert spurious <= 10 and kept == 50


def test_the_online_window_skips_akaikes_rule():
    """``akaike=False`` (the online model's refit, a window of hundreds of forwards): the fit with the cells as it
    comes, even where the rule would have dropped a beta the noise made up on 18 probes."""
    sizes = [1, 2, 4, 8, 16, 32, 64, 128, 256]
    for seed in range(50):
        rng = np.random.default_rng(seed)
        rows = np.array([(min(n, 8) * c, n, (ALPHA * min(n, 8) * c + GAMMA * n + DELTA) * rng.lognormal(0.0, 0.05),
                          n * c) for c in (64, 256) for n in sizes])
        ctx, bat, y, cells = rows.T
        ruled = fit_model(ctx, bat, y, cells=cells)
        raw = fit_model(ctx, bat, y, cells=cells, akaike=False)
        if raw.beta > 0 and ruled.beta == 0:
            assert ruled == fit_model(ctx, bat, y)  # the rule's choice: SmartSpec's model
            return
    pytest.fail("no seed where the rule dropped a made-up beta")


@pytest.mark.parametrize(("n", "per", "c"), [(1, 1, 0), (1, 512, 0), (8, 3, 250), (32, 1, 600), (4, 9, 1)])
def test_an_even_batchs_cells_are_its_chunks(n: int, per: int, c: int):
    """What a policy prices a batch's cells with (its totals only) is the sum of the chunks the runner counts when the
    tokens and the context are spread evenly: n sequences of c cached tokens and per new ones each."""
    assert even_cells(n * c, n * per, n) == pytest.approx(n * chunk_cells(per, c), rel=1e-12)
    assert even_cells(n * c, n * per, 0) == even_cells(n * c, n * per, 1)  # no sequences: one
