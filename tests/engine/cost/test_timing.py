"""The engine's forward-time predictions heal from the forwards it measures (adaserve.engine.cost.timing)."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from adaserve.engine.cost.cost_model import CostModel
from adaserve.engine.cost.profiler import summarise_timings
from adaserve.engine.cost.timing import (
    ForwardSplitter,
    OnlineCostModel,
    PromptLoad,
    median_ratio,
    median_rel_error,
    predict_many,
    scaled,
)
from adaserve.engine.model.runner import chunk_cells

# this machine's quiet CPU forward, roughly: 6.5 ms fixed, 0.16 ms per new token, 2 us per context token
TRUE = CostModel(alpha=2e-6, gamma=1.6e-4, delta=6.5e-3)


def forwards(rng: np.random.Generator, count: int, *, model: CostModel = TRUE, sigma: float = 0.05,
             stall_share: float = 0.0, fixed_shape: bool = False) -> list[tuple[int, int, float]]:
    """Forwards as the engine times them: 1-8 requests of 50-500 context tokens, 1-10 new tokens each,
    lognormal noise and an occasional 10x stall."""
    out = []
    for _ in range(count):
        r = 4 if fixed_shape else int(rng.integers(1, 9))
        c = 4 * 200 if fixed_shape else int(rng.integers(50, 501, r).sum())
        b = 4 * 5 if fixed_shape else int(rng.integers(1, 11, r).sum())
        y = model.predict(c, b) * float(rng.lognormal(0.0, sigma))
        out.append((c, b, y * (10.0 if rng.random() < stall_share else 1.0)))
    return out


def feed(m: OnlineCostModel, samples: list[tuple[int, int, float]]) -> OnlineCostModel:
    for c, b, y in samples:
        m.observe(c, b, y)
    return m


def test_helpers():
    assert scaled(TRUE, 2.0) == CostModel(2 * TRUE.alpha, 2 * TRUE.gamma, 2 * TRUE.delta)
    samples = [(100, 4, 2 * TRUE.predict(100, 4)), (10, 1, 3 * TRUE.predict(10, 1)), (0, 8, TRUE.predict(0, 8))]
    assert median_ratio(TRUE, samples) == pytest.approx(2.0)
    assert median_ratio(CostModel(0.0, 0.0, 0.0), samples) is None  # nothing to compare with
    assert median_rel_error(TRUE, samples) == pytest.approx(0.5)  # errors |p - y| / y: 1/2, 2/3, 0


def test_agreeing_profile_is_left_alone_despite_noise_and_stalls():
    m = feed(OnlineCostModel(TRUE, frozen=True), forwards(np.random.default_rng(0), 400, stall_share=0.2))
    assert m.source == "initial" and m.correction == 1.0 and m.model == TRUE


@pytest.mark.parametrize("factor", [5.0, 0.25])
def test_profile_off_by_a_constant_factor_is_scaled(factor: float, caplog: pytest.LogCaptureFixture):
    """A profile timed on a busier (5x) or quieter (0.25x) machine than the one serving."""
    rng = np.random.default_rng(1)
    with caplog.at_level(logging.WARNING, logger="adaserve.engine.cost.timing"):
        m = feed(OnlineCostModel(scaled(TRUE, factor), frozen=True), forwards(rng, 64, stall_share=0.1))
    assert m.source == "scaled" and m.correction == pytest.approx(1 / factor, rel=0.05)
    assert median_rel_error(m.model, forwards(rng, 200, sigma=0.0)) < 0.05
    assert len(caplog.records) == 1 and "scaled by" in caplog.records[0].getMessage()  # said once


def test_no_correction_before_enough_forwards():
    m = feed(OnlineCostModel(scaled(TRUE, 5.0), frozen=True), forwards(np.random.default_rng(2), 15))
    assert m.source == "initial" and m.model == scaled(TRUE, 5.0)


def test_correction_is_bounded_when_no_refit_is_possible():
    """Every forward the same shape: the terms cannot be separated, so only the clamped scale is left."""
    m = OnlineCostModel(scaled(TRUE, 100.0), frozen=True, max_correction=16.0)
    feed(m, forwards(np.random.default_rng(3), 64, fixed_shape=True))
    assert m.source == "scaled" and m.correction == pytest.approx(1 / 16)


def test_wrong_shape_is_replaced_by_a_refit():
    """A profile with the wrong shape (all delta, no per-token cost) cannot be fixed by a scale."""
    flat = CostModel(0.0, 0.0, TRUE.predict(1000, 20))
    rng = np.random.default_rng(4)
    m = feed(OnlineCostModel(flat, frozen=True), forwards(rng, 128))
    assert m.source == "refit"
    assert median_rel_error(m.model, forwards(rng, 200, sigma=0.0)) < 0.1
    assert median_rel_error(scaled(flat, median_ratio(flat, forwards(rng, 200)) or 1.0),
                            forwards(rng, 200, sigma=0.0)) > 0.2  # what the scale alone would have left


def test_correction_returns_to_the_profile_when_forwards_agree_again():
    rng = np.random.default_rng(5)
    m = feed(OnlineCostModel(TRUE, frozen=True, window=64), forwards(rng, 64, model=scaled(TRUE, 3.0)))
    assert m.source == "scaled" and m.correction == pytest.approx(3.0, rel=0.05)
    feed(m, forwards(rng, 64))  # the load is gone
    assert m.source == "initial" and m.model == TRUE


def test_busy_start_heals():
    """The issue's bad start: the cost model fitted from the busy table, then quiet forwards."""
    ms = [148, 828, 48, 790, 956, 93, 412, 1204, 556]
    timings = {c: {2**i: [t / 1e3 * (0.9 if c == 64 else 1.0)] for i, t in enumerate(ms)} for c in (64, 256)}
    busy = CostModel.from_dict(summarise_timings(timings, context=256)["cost_model"])
    rng = np.random.default_rng(6)
    probe = forwards(rng, 200, sigma=0.0)
    assert median_rel_error(busy, probe) > 5.0  # predicts forwards several times too slow
    m = feed(OnlineCostModel(busy, frozen=True), forwards(rng, 64, stall_share=0.1))
    assert m.source in ("scaled", "refit")
    assert median_rel_error(m.model, probe) < 0.15


def test_unprofiled_model_refits_and_scales_its_guess():
    rng = np.random.default_rng(7)
    m = feed(OnlineCostModel(CostModel(0.0, 0.0, 0.02)), forwards(rng, 64))
    assert m.source == "refit" and median_rel_error(m.model, forwards(rng, 200, sigma=0.0)) < 0.1
    guess = feed(OnlineCostModel(CostModel(0.0, 0.0, 0.1)), forwards(rng, 64, fixed_shape=True))
    assert guess.source == "scaled"  # no refit possible: the flat guess at least takes the right size
    assert guess.predict(800, 20) == pytest.approx(TRUE.predict(800, 20), rel=0.05)


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan"), float("inf")])
def test_unusable_timings_are_ignored(bad: float):
    m = OnlineCostModel(TRUE, frozen=True)
    m.observe(100, 4, bad)
    assert len(m.samples) == 0


def test_forward_splitter_gives_each_forward_its_own_time_and_counts():
    """Issue 14: a beam search's first draft forward also runs the catch-up tokens. Timed alone, each
    forward is a sample with its own counts; the span divided by the depth was not."""
    now = [10.0]
    split = ForwardSplitter(lambda: now[0])
    split.start()
    for ctx, new, secs in [(300, 40, 0.009), (340, 8, 0.002), (348, 8, 0.002)]:  # catch-up, then two beam steps
        now[0] += secs
        split(ctx, new, None if new == 40 else 2 * ctx)  # the catch-up's cells left out: one new token a sequence
    now[0] += 0.0005  # host work after the last forward (the last level's expansion)
    samples = split.finish()
    assert [(c, b, k) for c, b, _, k in samples] == [(300, 40, 340), (340, 8, 680), (348, 8, 696)]
    assert [y for _, _, y, _ in samples] == pytest.approx([0.009, 0.002, 0.0025])
    assert sum(y for _, _, y, _ in samples) == pytest.approx(now[0] - 10.0)  # the span, nothing lost
    split.start()  # a new search starts empty
    assert split.finish() == []


def test_vectorised_predictions_are_the_models_own_bit_for_bit():
    """median_ratio and median_rel_error predict the whole window at once (issue 30): the same numbers."""
    rng = np.random.default_rng(8)
    samples = forwards(rng, 300)
    models = (TRUE, CostModel(3e-6, 1e-4, 2e-3, gamma_above=5e-4, knee=12), CostModel(0.0, 0.0, 0.0),
              CostModel(1e-6, 1e-4, 2e-3, gamma_above=5e-4, knee=12, beta=4e-7))
    for model in models:
        want = [model.predict(c, b) for c, b, _ in samples]
        assert predict_many(model, samples).tolist() == want
        # with each sample's cells (here three tokens' worth of context) as the fourth column
        with_cells = [(c, b, y, 3 * c) for c, b, y in samples]
        assert predict_many(model, with_cells).tolist() == [model.predict(c, b, k) for c, b, _, k in with_cells]
        ratios = [y / p for (_, _, y), p in zip(samples, want, strict=True) if p > 0]
        assert median_ratio(model, samples) == (float(np.median(ratios)) if ratios else None)
        if model.delta > 0:
            assert median_rel_error(model, samples) == float(np.median(
                [abs(p - y) / y for (_, _, y), p in zip(samples, want, strict=True)]))


def test_least_squares_refit_runs_once_a_quarter_of_the_window_is_new(monkeypatch: pytest.MonkeyPatch):
    """Unprofiled: checked every 16 forwards, refit once a quarter of the window's samples are new (every 16
    up to 64 samples, as before; every 64 once a 256-window is full: issue 30, ~1.5 ms each on a CPU);
    between refits the model stays the last refit."""
    from adaserve.engine.cost import timing

    calls = []
    real = timing.fit_model

    def counting(ctx, bat, y, **kw):
        calls.append(len(y))
        return real(ctx, bat, y, **kw)

    monkeypatch.setattr(timing, "fit_model", counting)
    m = OnlineCostModel(CostModel(0.0, 0.0, 0.02))
    rng = np.random.default_rng(9)
    models = []
    for c, b, y in forwards(rng, 512):
        m.observe(c, b, y)
        models.append(m.model)
    refit_at = [16, 32, 48, 64, 96, 128, 176, 240, 304, 368, 432, 496]  # samples seen at each refit
    assert calls == [min(n, 256) for n in refit_at] and m.source == "refit"
    assert models[303] == models[366] != models[367]  # between refits the model is unchanged
    assert median_rel_error(m.model, forwards(rng, 200, sigma=0.0)) < 0.1


def test_a_refit_hands_the_fit_the_model_it_replaces(monkeypatch: pytest.MonkeyPatch):
    """Each least-squares refit passes its last refit (None before the first) as ``last``: the terms that model kept
    are the first support the solve tries (cost_model._nnls_small), the same model in fewer solves."""
    from adaserve.engine.cost import timing

    seen = []
    real = timing.fit_model

    def recording(ctx, bat, y, **kw):
        seen.append(kw.get("last", "missing"))
        return real(ctx, bat, y, **kw)

    monkeypatch.setattr(timing, "fit_model", recording)
    m = OnlineCostModel(CostModel(0.0, 0.0, 0.02))
    models = []
    for c, b, y in forwards(np.random.default_rng(12), 128):
        m.observe(c, b, y)
        models.append(m.model)
    assert len(seen) >= 3 and seen[0] is None
    refits = [models[n - 1] for n in (16, 32, 48, 64, 96, 128)[: len(seen)]]  # the model after each refit
    assert seen[1:] == refits[: len(seen) - 1]


def test_refit_is_fit_cost_model_on_the_window():
    """The window goes to the fit as columns (cost_model.fit_model, no per-sample pass): the same model."""
    from adaserve.engine.cost.cost_model import fit_cost_model

    m = feed(OnlineCostModel(CostModel(0.0, 0.0, 0.02), window=48), forwards(np.random.default_rng(10), 96))
    assert m.source == "refit"
    assert m.model == fit_cost_model(list(m.samples))[0]
    knee = CostModel(1e-6, 1e-4, 1e-3, gamma_above=2e-4, knee=20)
    k = feed(OnlineCostModel(knee), forwards(np.random.default_rng(11), 64, model=knee))
    assert k.model == fit_cost_model(list(k.samples), knee=20)[0]


@pytest.mark.parametrize("frozen", [False, True])
def test_checks_between_refits_change_nothing_and_unprofiled_ones_read_no_window(
        monkeypatch: pytest.MonkeyPatch, frozen: bool) -> None:
    """Issue 30: an unprofiled model reads its window only when a refit is due; every prediction is the one a
    model that recalibrated at every check (the former way) makes, profiled or not."""
    import adaserve.engine.cost.timing as timing

    rng = np.random.default_rng(11)
    samples = forwards(rng, 400, stall_share=0.05)
    initial = scaled(TRUE, 3.0)  # a profile off by 3x: scaled, then refit or not
    fast, every = OnlineCostModel(initial, frozen=frozen), OnlineCostModel(initial, frozen=frozen)
    calls: list[bool] = []
    recalibrate = OnlineCostModel._recalibrate

    def counted(self: OnlineCostModel, window: np.ndarray) -> None:
        if self is fast:
            calls.append(self._refit_due())
        recalibrate(self, window)

    monkeypatch.setattr(OnlineCostModel, "_recalibrate", counted)
    checks = 0
    for c, b, y in samples:
        fast.observe(c, b, y)
        # the former way: every check recalibrates
        every.samples.append((c, b, y))
        while len(every.samples) > every.window:
            every.samples.popleft()
        every._since_fit += 1
        every._since_refit += 1
        if every._since_fit >= every.refit_every and len(every.samples) >= every.min_samples:
            every._since_fit = 0
            checks += 1
            recalibrate(every, timing._columns(every.samples))
        assert fast.predict(c, b) == every.predict(c, b) and fast.source == every.source
    if frozen:
        assert len(calls) == checks
    else:
        assert all(calls) and 0 < len(calls) < checks  # only the due ones, and some were not


def test_an_online_refit_learns_the_attention_cells_and_prices_a_batch_by_its_share():
    """Forwards whose attention reads each sequence's keys once per new token (a CPU's): the window's cells separate
    beta from alpha, and ``for_batch`` prices n requests sharing the tokens evenly as such a forward costs, each
    request's tokens a causal chunk over its context (runner.chunk_cells)."""
    true = CostModel(alpha=1e-6, gamma=1.2e-4, delta=4e-3, beta=3e-7)
    rng = np.random.default_rng(11)
    m = OnlineCostModel(CostModel(0.0, 0.0, 0.02))
    for _ in range(96):
        r, per = int(rng.integers(1, 33)), int(rng.integers(1, 7))
        contexts = rng.integers(50, 801, r)
        c, cells = int(contexts.sum()), sum(chunk_cells(per, int(x)) for x in contexts)
        m.observe(c, r * per, true.predict(c, r * per, cells), cells)
    assert m.source == "refit" and m.model.beta == pytest.approx(true.beta, rel=1e-6)
    price = m.for_batch(8)
    want = 8 * chunk_cells(3, 300)  # 8 requests of 300 cached tokens, 3 new each
    assert price(8 * 300, 8 * 3) == pytest.approx(true.predict(2400, 24, want), rel=1e-6)
    assert m.for_batch(0)(500, 4) == pytest.approx(true.predict(500, 4, chunk_cells(4, 500)), rel=1e-6)  # no requests
    # a sample without cells has one new token a sequence
    m.observe(1000, 10, 0.01)
    assert m.samples[-1] == (1000, 10, 0.01, 1010)


def test_a_prompt_chunk_is_priced_over_its_own_keys():
    """A mixed forward: 4 decoding requests of 600 cached tokens verify 3 tokens each beside a 256-token prompt chunk
    whose request holds 100. The chunk reads its own 100 keys and itself, not the decoding requests' 600: spread over
    them it would cost 256 x 600 cells it never reads."""
    true = CostModel(alpha=1e-6, gamma=1.2e-4, delta=4e-3, beta=3e-7)
    m = OnlineCostModel(true, frozen=True)
    prompt = PromptLoad.of([(256, 100)])
    assert prompt == PromptLoad(256, 100, chunk_cells(256, 100))
    cells = 4 * chunk_cells(3, 600) + chunk_cells(256, 100)  # what the runner counts for that forward
    assert m.for_batch(4, prompt)(2400, 12 + 256) == pytest.approx(true.predict(2400 + 100, 268, cells), rel=1e-9)
    # the same forward priced as if the chunk's tokens were the decoding requests': more than a fifth dearer
    assert m.for_batch(4)(2400, 268) > 1.2 * m.for_batch(4, prompt)(2400, 268)
    # several chunks add up; no chunk (or an empty one) is the plain batch price
    two = PromptLoad.of([(200, 0), (56, 300)])
    assert (two.tokens, two.context, two.cells) == (256, 300, chunk_cells(200, 0) + chunk_cells(56, 300))
    assert m.for_batch(4, PromptLoad())(2400, 12) == m.for_batch(4)(2400, 12)
