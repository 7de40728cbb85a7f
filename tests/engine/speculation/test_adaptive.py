"""Eq. 8-9: speculation depth and width from the number of active requests."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from adaserve.engine.speculation.adaptive import AdaptiveConfig, depth_width


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


def test_path_acceptance_is_the_geometric_mle() -> None:
    from adaserve.engine.speculation.adaptive import PathAcceptance

    p = PathAcceptance(window=2, prior=0.5)
    assert p.alpha == 0.5  # nothing observed yet
    p.observe(6, 2)  # 6 levels accepted, 2 paths stopped by a rejection
    assert p.alpha == 0.75
    p.observe(0, 0)  # no speculation: ignored
    p.observe(2, 2)
    p.observe(4, 0)  # the window keeps the last two
    assert p.alpha == 6 / 8
    p.clear()
    assert p.alpha == 0.5 and not p.samples


def test_path_acceptance_keeps_its_windows_sums_as_samples_come_and_go() -> None:
    """alpha reads running sums (it is read every iteration): they stay the window's, sample by sample."""
    from adaserve.engine.speculation.adaptive import PathAcceptance

    rng = np.random.default_rng(3)
    p = PathAcceptance(window=5, prior=0.6, prior_weight=2.0)
    for _ in range(200):
        p.observe(int(rng.integers(0, 5)), int(rng.integers(0, 3)))
        acc, rej = sum(a for a, _ in p.samples), sum(r for _, r in p.samples)
        assert len(p.samples) <= 5
        assert p.alpha == (acc + 2.0 * 0.6) / (acc + rej + 2.0)


def test_goodput_depth_goes_deep_when_draft_steps_are_cheap_and_shallow_when_not() -> None:
    from adaserve.engine.speculation.adaptive import goodput_depth

    def target(ctx: int, k: int) -> float:
        return 0.025 + 0.00016 * max(0, k - 134)  # a roofline: flat to the ridge, then linear

    cheap = lambda ctx, k: 0.0005  # noqa: E731
    dear = lambda ctx, k: 0.02  # noqa: E731
    kw = {"alpha": 0.8, "d_min": 1, "d_max": 8, "n_context": 0, "extra_tokens": 0, "t_target": target}
    assert goodput_depth(1, 2, t_draft=cheap, **kw) == 8
    assert goodput_depth(1, 2, t_draft=dear, **kw) == 1
    # a big batch pushes verification past the ridge: deep chains stop paying
    assert goodput_depth(64, 2, t_draft=cheap, **kw) < goodput_depth(4, 2, t_draft=cheap, **kw)
    # never below d_min, never above d_max
    assert goodput_depth(1, 2, t_draft=dear, **{**kw, "d_min": 2}) == 2
    assert goodput_depth(1, 2, t_draft=cheap, **{**kw, "d_max": 3}) == 3


def test_bounds_follow_the_draft_to_target_cost_ratio() -> None:
    from adaserve.engine.speculation.adaptive import bounds_for_device

    cpu = bounds_for_device(AdaptiveConfig(), t_target_s=0.043, t_draft_s=0.043 / 5.6, draft_budget=16)
    assert (cpu.d_max, cpu.w_max, cpu.b2) == (4, 2, 16)
    gpu = bounds_for_device(AdaptiveConfig(), t_target_s=0.0243, t_draft_s=0.0018, draft_budget=128)
    assert (gpu.d_max, gpu.w_max, gpu.b2) == (8, 4, 128)
    paper = bounds_for_device(AdaptiveConfig(), t_target_s=0.030, t_draft_s=0.005, draft_budget=64)  # its 1B/70B
    assert (paper.d_max, paper.w_max) == (4, 3)
    assert bounds_for_device(AdaptiveConfig(), t_target_s=0.0, t_draft_s=1.0, draft_budget=1) == AdaptiveConfig()


def test_the_width_stays_a_chain_where_each_verified_token_costs_compute() -> None:
    from adaserve.engine.speculation.adaptive import bounds_for_device

    def cpu(k: int) -> float:  # the demo target's table on a 2-core CPU: 3.5 ms at 4 tokens, 4.9 at 8, 6.2 at 16
        return float(np.interp(k, [1, 2, 4, 8, 16, 32], [3.16, 3.15, 3.52, 4.85, 6.23, 7.29])) / 1e3

    def gpu(k: int) -> float:  # the artifact's Llama-3.1-70B table: 30 ms at 1 token, 31.4 at 8, 33 at 16
        return float(np.interp(k, [1, 8, 16, 32, 128], [30.0, 31.4, 33.0, 36.1, 55.0])) / 1e3

    kw = {"t_target_s": 0.0032, "t_draft_s": 0.0006, "draft_budget": 64}
    assert bounds_for_device(AdaptiveConfig(), **kw).w_max == 3  # the draft's knee alone allows 3
    assert bounds_for_device(AdaptiveConfig(), **kw, t_verify=cpu).w_max == 1  # 9 tokens cost 1.3x 5
    paper = {"t_target_s": 0.030, "t_draft_s": 0.005, "draft_budget": 64}
    assert bounds_for_device(AdaptiveConfig(), **paper, t_verify=gpu).w_max == 3  # 13 tokens cost what 5 do
    # the rest does not move; chains, their length by goodput, may be SmartSpec's 8 long (chain_rates)
    narrow, wide = bounds_for_device(AdaptiveConfig(), **kw, t_verify=cpu), bounds_for_device(AdaptiveConfig(), **kw)
    assert (narrow.d_min, narrow.b2) == (wide.d_min, wide.b2)
    assert (narrow.d_max, wide.d_max) == (8, 4)
    eq8 = AdaptiveConfig(depth_rule="eq8")
    assert bounds_for_device(eq8, **kw, t_verify=cpu).d_max == bounds_for_device(eq8, **kw).d_max == 4


def test_the_width_counts_the_drafts_levels_too() -> None:
    from adaserve.engine.speculation.adaptive import bounds_for_device

    def flat(k: int) -> float:  # a verifier flat over these sizes (below an accelerator's knee)
        return 0.030 + 1e-5 * k

    def slow_draft(k: int) -> float:  # a draft whose beams cost: 5 ms a row, 1.5 ms more for every further row
        return 0.005 + 0.0015 * (k - 1)

    paper = {"t_target_s": 0.030, "t_draft_s": 0.005, "draft_budget": 64}
    assert bounds_for_device(AdaptiveConfig(), **paper, t_verify=flat).w_max == 3  # verification alone: free
    # d_max 4: the chain's iteration 5 + 3 x 5 + 30 ms, the 3-wide beam's 5 + 3 x 8 + 30: 18% more; 2-wide: 9%
    assert bounds_for_device(AdaptiveConfig(), **paper, t_verify=flat, t_draft_at=slow_draft).w_max == 1
    assert bounds_for_device(AdaptiveConfig(), **paper, t_verify=flat, t_draft_at=lambda k: 0.005).w_max == 3

    # a 2-core Xeon with AMX (issue 29's wall clock): 7 verified tokens at 1.06x the price of 4, so beams no more
    def xeon(k: int) -> float:
        return float(np.interp(k, [1, 2, 4, 8, 16], [3.229, 4.025, 4.852, 5.25, 6.843])) / 1e3

    def xeon_draft(k: int) -> float:
        return float(np.interp(k, [1, 2, 4, 8], [0.873, 1.091, 1.018, 1.246])) / 1e3

    amx = bounds_for_device(AdaptiveConfig(), t_target_s=0.003229, t_draft_s=0.000873, draft_budget=64,
                            t_verify=xeon, t_draft_at=xeon_draft)
    assert (amx.d_max, amx.w_max) == (8, 1)  # chains, as long as the goodput rule finds they pay


def _flat_then_linear(flat_s: float, per_token_s: float, ridge: int) -> Callable[[int, int], float]:
    return lambda ctx, k: flat_s + per_token_s * max(0, k - ridge)


def test_goodput_shape_prices_a_beam_at_its_ranks_summed_rates() -> None:
    from adaserve.engine.speculation.adaptive import goodput_shape

    kw = {"width": 3, "budget": 64, "d_min": 1, "d_max": 4, "n_context": 0, "extra_tokens": 0}
    # a CPU: every drafted and verified token costs compute, so the depth follows what a level is worth (a draft
    # token at 1e-4 s: at 2e-4 the two depths' goodputs are within 2%, and the catch-up priced at the tokens a
    # depth emits, adaptive.draft_seconds, tips them to one level)
    cpu = {"t_target": _flat_then_linear(0.0023, 6.8e-5 * 4, 0), "t_draft": _flat_then_linear(0.0005, 1e-4, 0)}
    poor = goodput_shape(1, rank_rates=(0.3, 0.02, 0.01), **kw, **cpu)
    rich = goodput_shape(1, rank_rates=(0.4, 0.35, 0.2), **kw, **cpu)  # the siblings add to a level's chance
    assert rich > poor
    # an accelerator below its knee: depth is nearly free, the deepest tree wins
    gpu = {"t_target": _flat_then_linear(0.025, 1e-4, 128), "t_draft": _flat_then_linear(0.002, 1e-5, 64)}
    assert goodput_shape(1, rank_rates=(0.6, 0.2, 0.1), **kw, **gpu) == 4
    with pytest.raises(ValueError, match="rate for each"):
        goodput_shape(1, rank_rates=(0.5,), **kw, **gpu)


def test_the_adaserve_policy_keeps_eq9_s_width_for_beams_learnt_rates_or_not() -> None:
    """Where bounds_for_device allows beams (verifying them costs about what a chain does), the width is Eq. 9's;
    the learnt rates price its depth (the width by goodput drafted narrower trees than the replay's table pays
    for: policies._Adaptive)."""
    from adaserve.engine.speculation.policies import BatchView, make_policy

    policy = make_policy("adaserve")
    cpu = {"predict_target": _flat_then_linear(0.0023, 2.7e-4, 0), "predict_draft": _flat_then_linear(5e-4, 2e-4, 0)}
    unlearnt = policy.tree_shape(BatchView(n_active=1, n_context=128, budget=64, rank_rates=lambda w: None, **cpu))
    assert unlearnt is not None and unlearnt.width == policy.adaptive.w_max
    learnt = policy.tree_shape(BatchView(n_active=1, n_context=128, budget=64,
                                         rank_rates=lambda w: (0.75, 0.02, 0.01, 0.0)[:w], **cpu))
    assert learnt is not None and learnt.width == policy.adaptive.w_max


def test_plain_decoding_where_no_tree_pays_for_itself() -> None:
    from adaserve.engine.speculation.adaptive import goodput_depth, goodput_shape

    # int4 weights on a CPU: verifying costs about linearly in tokens (a packed kernel per row), so trees cost
    # what decoding their tokens one by one would; at 8 requests no depth beats one token per forward
    rows = _flat_then_linear(0.022, 0.005, 1)
    draft = _flat_then_linear(0.003, 0.0005, 1)
    kw = {"d_max": 4, "n_context": 0, "extra_tokens": 0, "t_target": rows, "t_draft": draft}
    assert goodput_depth(8, 1, alpha=0.7, d_min=0, **kw) == 0
    assert goodput_shape(8, width=2, rank_rates=(0.7, 0.05), budget=64, d_min=0, **kw) == 0
    # d_min = 1 keeps speculating; a lone request, where a tree costs little more than a token, speculates
    assert goodput_depth(8, 1, alpha=0.7, d_min=1, **kw) >= 1
    assert goodput_depth(1, 1, alpha=0.7, d_min=0, **kw) >= 1
    # an accelerator below its knee: speculation always pays
    gpu = {**kw, "t_target": _flat_then_linear(0.025, 1e-4, 128), "t_draft": _flat_then_linear(0.002, 1e-5, 64)}
    assert goodput_depth(8, 2, alpha=0.7, d_min=0, **gpu) >= 1


def test_the_policy_turns_speculation_off_when_plain_decoding_is_predicted_faster() -> None:
    from adaserve.engine.speculation.adaptive import bounds_for_device
    from adaserve.engine.speculation.policies import BatchView, make_policy

    rows = {"predict_target": _flat_then_linear(0.022, 0.005, 1), "predict_draft": _flat_then_linear(0.003, 5e-4, 1)}
    # measured costs (the profile's bounds) may turn speculation off; the unmeasured default keeps a tree
    assert make_policy("adaserve").tree_shape(BatchView(n_active=8, n_context=1024, budget=64, **rows)) is not None
    policy = make_policy("adaserve")
    object.__setattr__(policy, "adaptive", bounds_for_device(policy.adaptive, t_target_s=0.022, t_draft_s=0.003,
                                                            draft_budget=16))
    assert policy.adaptive.d_min == 0
    assert policy.tree_shape(BatchView(n_active=8, n_context=1024, budget=64, **rows)) is None
    assert policy.tree_shape(BatchView(n_active=1, n_context=128, budget=64, **rows)) is not None


def test_plain_decoding_drafts_its_best_tree_now_and_then() -> None:
    """A run of plain iterations learns nothing about trees: every PLAIN_STREAK-th one drafts the best tree,
    so costs and acceptance measured on it can turn speculation back on."""
    from adaserve.engine.speculation.adaptive import bounds_for_device
    from adaserve.engine.speculation.policies import PLAIN_STREAK, BatchView, make_policy

    rows = {"predict_target": _flat_then_linear(0.022, 0.005, 1), "predict_draft": _flat_then_linear(0.003, 5e-4, 1)}
    policy = make_policy("adaserve")
    object.__setattr__(policy, "adaptive", bounds_for_device(policy.adaptive, t_target_s=0.022, t_draft_s=0.003,
                                                            draft_budget=16))
    busy = BatchView(n_active=8, n_context=1024, budget=64, **rows)
    shapes = [policy.tree_shape(busy) for _ in range(3 * PLAIN_STREAK)]
    drafted = [i for i, s in enumerate(shapes) if s is not None]
    assert drafted == [PLAIN_STREAK - 1, 2 * PLAIN_STREAK - 1, 3 * PLAIN_STREAK - 1]
    assert all(s.depth >= 1 and s.probe for s in shapes if s is not None)  # one request of the batch drafts
    # a tree that pays resets the count, and is the whole batch's
    lone = policy.tree_shape(BatchView(n_active=1, n_context=128, budget=64, **rows))
    assert lone is not None and not lone.probe
    assert policy.tree_shape(busy) is None
    # a lone request's streak (a draft dearer than the target): its probe is simply its tree
    dear = BatchView(n_active=1, n_context=1024, budget=64, predict_target=rows["predict_target"],
                     predict_draft=_flat_then_linear(0.05, 5e-4, 1))
    lone_shapes = [policy.tree_shape(dear) for _ in range(PLAIN_STREAK)]
    assert [s is not None for s in lone_shapes] == [False] * (PLAIN_STREAK - 2) + [True, False]
    assert not lone_shapes[-2].probe  # type: ignore[union-attr]



def test_a_fresh_chains_depth_is_smartspecs_from_the_first_iteration() -> None:
    """Before any rank rate is learnt, a chain's depth is the one SmartSpec picks from the same window and costs,
    plain decoding included: one rejected first token does not read as alpha 0 (the geometric estimate, which has
    no prior, decoded plainly for whole PLAIN_STREAKs at the start of every fresh engine on the demo pair)."""
    from adaserve.engine.speculation.policies import BatchView, make_policy
    from adaserve.engine.speculation.smartspec import best_length

    costs = {"predict_target": _flat_then_linear(0.003, 3e-4, 1), "predict_draft": _flat_then_linear(0.0008, 1e-5, 8)}
    view = BatchView(n_active=1, n_context=256, budget=128, rank_rates=lambda w: None, **costs)
    chains = make_policy("adaserve")
    object.__setattr__(chains, "adaptive", AdaptiveConfig(d_min=0, d_max=8, w_max=1))
    smart = make_policy("smartspec")
    steps = [(0, 2), (0, 1), (1, 3), (0, 4), (4, 4), (8, 8), (8, 8), (0, 8), (2, 2)]
    depths, theirs = [], []
    for accepted, proposed in steps:
        chains.observe(accepted, proposed)
        chains.observe_paths(accepted, int(accepted < proposed))
        smart.observe(accepted, proposed)
        shape = chains.tree_shape(view)
        depths.append(0 if shape is None else shape.depth)
        theirs.append(best_length(n=1, n_context=256, alpha=smart.acceptance.alpha, max_k=8,
                                  t_target=view.predict_target, t_draft=view.predict_draft))
    assert depths == theirs
    assert depths[0] > 0  # after one rejected 2-token chain the geometric estimate said 0: plain decoding


def test_a_chains_depth_follows_the_latest_iterations() -> None:
    """Learnt rank rates say a chain's next token is accepted 60% of the time; the latest iterations accepted
    every drafted token (predictable text): the chain grows, and shrinks again once they stop. Only where the
    device's width bound is 1: a beam's depth keeps the learnt rates."""
    from adaserve.engine.speculation.policies import BatchView, make_policy

    costs = {"predict_target": _flat_then_linear(0.003, 4e-4, 1), "predict_draft": _flat_then_linear(0.001, 1e-5, 8)}
    view = BatchView(n_active=1, n_context=256, budget=128, rank_rates=lambda w: (0.6,) * w, **costs)
    chains, beams = make_policy("adaserve"), make_policy("adaserve")
    object.__setattr__(chains, "adaptive", AdaptiveConfig(d_min=1, d_max=8, w_max=1))
    object.__setattr__(beams, "adaptive", AdaptiveConfig(d_min=1, d_max=8, w_max=2, b2=1))  # Eq. 9: one beam
    shallow = chains.tree_shape(view)
    assert shallow is not None and shallow == beams.tree_shape(view)
    for policy in (chains, beams):
        for _ in range(32):
            policy.observe(8, 8)  # whole 8-token chains accepted
    deep = chains.tree_shape(view)
    assert deep is not None and deep.depth > shallow.depth
    assert beams.tree_shape(view) == shallow
    for _ in range(32):  # the window forgets them: every chain rejected at its first token
        chains.observe(0, 8)
    assert chains.tree_shape(view).depth <= shallow.depth


def _slo_costs() -> dict:
    # 8 requests at alpha 0.8: goodput peaks at 2-token chains (27.6 ms for 2.44 tokens each)
    return {"width": 1, "rank_rates": (0.8,), "budget": 64, "d_min": 0, "d_max": 8, "n_context": 0,
            "extra_tokens": 0, "t_target": _flat_then_linear(0.010, 5e-4, 0),
            "t_draft": _flat_then_linear(0.002, 1e-4, 0)}


def test_the_slo_shape_goes_deeper_for_a_request_behind_its_target() -> None:
    import numpy as np

    from adaserve.engine.speculation.adaptive import goodput_shape, slo_shape

    kw = _slo_costs()
    assert goodput_shape(8, **kw) == 2
    # A(r) = base + rate * T: request 0 owes 2 tokens at a 30 ms TPOT SLO, request 1 is on schedule, the rest have
    # no SLO. Request 0 needs 2 + T / 30 ms: 2.92 tokens at depth 2 (2.44 expected), 3.6 at depth 5 (3.69)
    base, rate = np.zeros(8), np.zeros(8)
    base[0], rate[:2] = 2.0, 1 / 0.030
    assert slo_shape(8, base=base, rate=rate, **kw) == 5  # the shallowest, fastest depth that serves both
    # no SLO among them, or one no depth can serve (owing 10 tokens): goodput's shape
    assert slo_shape(8, base=np.zeros(8), rate=np.zeros(8), **kw) == 2
    base[0] = 10.0
    assert slo_shape(8, base=base, rate=rate, **kw) == 2


def test_the_slo_shape_keeps_a_short_iteration_when_a_deeper_one_pushes_a_tight_request_off() -> None:
    import numpy as np

    from adaserve.engine.speculation.adaptive import slo_shape

    kw = _slo_costs()
    # on schedule at a 12 ms TPOT SLO: A = T / 12 ms, met up to depth 3 (2.87 of 2.95 at 34.4 ms), not at 4
    # (3.43 of 3.36); a request owing 2 tokens at 30 ms is met from depth 5 only: one each way, goodput decides
    base, rate = np.zeros(8), np.zeros(8)
    rate[0], base[1], rate[1] = 1 / 0.012, 2.0, 1 / 0.030
    assert slo_shape(8, base=base, rate=rate, **kw) == 2
    base[3], rate[3] = 2.0, 1 / 0.030
    assert slo_shape(8, base=base, rate=rate, **kw) == 5  # two behind outnumber one tight request
    rate[2] = 1 / 0.012
    assert slo_shape(8, base=base, rate=rate, **kw) == 2  # two tight ones: a tie again, goodput decides


def _slo_shape_one_depth_at_a_time(n: int, *, base: np.ndarray, rate: np.ndarray, alphas: np.ndarray | None,
                                   width: int, **kw: object) -> int:
    """slo_shape's rule written out depth by depth (its docstring's maths, a loop over _priced_depths)."""
    from adaserve.engine.speculation.adaptive import MAX_ALPHA, _priced_depths

    own = None if alphas is None or width != 1 else np.minimum(alphas, MAX_ALPHA)
    best_d, best = max(kw["d_min"], 1), (-1, -1.0)  # type: ignore[call-overload]
    for d, cost, emitted in _priced_depths(n, width=width, **kw):  # type: ignore[arg-type]
        each = np.full(len(base), emitted) if own is None else (1 - own ** (d + 1)) / (1 - own)
        on_slo = int(np.count_nonzero((rate > 0) & (base + rate * cost <= each)))
        goodput = float(each.sum()) / max(cost, 1e-12)
        if on_slo > best[0] or (on_slo == best[0] and goodput > best[1] * (1 + 1e-9)):
            best_d, best = d, (on_slo, goodput)
    return best_d


def test_the_slo_shape_weighs_every_depth_at_once_as_it_would_one_at_a_time() -> None:
    """slo_shape builds one [D, n] array over the candidate depths (issue 30): the same depth as the rule applied
    depth by depth, over random batches with and without per-request rates (n = 0 included)."""
    from adaserve.engine.speculation.adaptive import slo_shape

    rng = np.random.default_rng(7)
    for case in range(600):
        n, width = int(rng.integers(0, 64)) if case % 10 else 0, int(rng.integers(1, 4))
        a, b = rng.uniform(1e-5, 1e-3, 2)
        kw = dict(width=width, rank_rates=tuple(rng.uniform(0, 0.6, size=width)), budget=int(rng.integers(1, 512)),
                  d_min=int(rng.integers(0, 3)), d_max=int(rng.integers(1, 9)), n_context=int(rng.integers(0, 5000)),
                  extra_tokens=int(rng.integers(0, 64)), t_target=lambda c, k, a=a: a * k + 1e-6 * c + 0.002,
                  t_draft=lambda c, k, b=b: b * k + 0.0005)
        base = rng.uniform(-2, 3, size=n) * (rng.random(n) < 0.8)
        rate = rng.uniform(0, 50, size=n) * (rng.random(n) < 0.7)
        alphas = rng.uniform(0, 1, size=n) if case % 2 else None
        want = _slo_shape_one_depth_at_a_time(n, base=base, rate=rate, alphas=alphas, **kw)
        assert slo_shape(n, base=base, rate=rate, alphas=alphas, **kw) == want, (case, kw)


def test_a_lone_requests_slo_shape_is_the_rule_applied_depth_by_depth() -> None:
    """One request (slo_shape's lone path, its counts over Python floats): the rule's depth on random costs, SLO
    lines and bounds, with and without an SLO."""
    from adaserve.engine.speculation.adaptive import slo_shape

    rng = np.random.default_rng(30)
    for case in range(600):
        width = int(rng.integers(1, 4))
        a, b = rng.uniform(1e-5, 1e-3, 2)
        kw = dict(width=width, rank_rates=tuple(rng.uniform(0, 0.9, size=width)), budget=int(rng.integers(1, 64)),
                  d_min=int(rng.integers(0, 3)), d_max=int(rng.integers(1, 9)), n_context=int(rng.integers(0, 5000)),
                  extra_tokens=int(rng.integers(0, 8)), t_target=lambda c, k, a=a: a * k + 1e-6 * c + 0.002,
                  t_draft=lambda c, k, b=b: b * k + 0.0005)
        base = rng.uniform(0, 3, size=1) * (case % 5 != 0)
        rate = rng.uniform(0, 400, size=1) * (case % 7 != 0)
        want = _slo_shape_one_depth_at_a_time(1, base=base, rate=rate, alphas=None, **kw)
        assert slo_shape(1, base=base, rate=rate, **kw) == want, (case, kw)


def test_the_slo_depth_rule_reads_the_batch_slo_lines() -> None:
    import numpy as np

    from adaserve.engine.speculation.adaptive import AdaptiveConfig
    from adaserve.engine.speculation.policies import AdaServe, BatchView, reads_slo_lines

    bounds = {"d_min": 0, "d_max": 8, "w_max": 1}
    costs = {"predict_target": _flat_then_linear(0.010, 5e-4, 0), "predict_draft": _flat_then_linear(0.002, 1e-4, 0)}
    lines = np.zeros((8, 2))
    # at the policy's prior alpha (0.7) goodput drafts one token; owing 1.2 tokens at 30 ms needs two
    lines[0] = (1.2, 1 / 0.030)
    goodput = AdaServe(adaptive=AdaptiveConfig(**bounds, depth_rule="goodput"))
    slo = AdaServe(adaptive=AdaptiveConfig(**bounds, depth_rule="slo"))
    assert not reads_slo_lines(goodput) and reads_slo_lines(slo)
    view = BatchView(n_active=8, n_context=0, budget=64, slo_lines=lines, **costs)
    plain_view = BatchView(n_active=8, n_context=0, budget=64, **costs)
    shallow = goodput.tree_shape(view)
    assert shallow is not None and slo.tree_shape(plain_view) == shallow  # no lines: goodput's shape
    deep = slo.tree_shape(view)
    assert deep is not None and deep.depth > shallow.depth and deep.width == 1


def test_the_draft_s_first_forward_is_priced_at_the_tokens_a_depth_emits() -> None:
    """draft_seconds: the catch-up forward feeds what the last iteration emitted (n * l tokens, at least the n
    roots), each later level n * w nodes; below a knee, where both cost the same, exactly d * T(n * w)."""
    from adaserve.engine.speculation.adaptive import draft_seconds, expected_emitted

    linear = _flat_then_linear(0.002, 1e-4, 0)  # a CPU: 2 ms + 0.1 ms a token
    assert draft_seconds(0, 8, 1, 0, linear, 1.0) == 0.0
    l3 = expected_emitted(0.8, 3)  # 2.95 tokens a request
    assert draft_seconds(3, 8, 1, 0, linear, l3) == pytest.approx(linear(0, round(8 * l3)) + 2 * linear(0, 8))
    assert draft_seconds(3, 8, 2, 0, linear, l3) == pytest.approx(linear(0, 24) + 2 * linear(0, 16))
    assert draft_seconds(1, 8, 2, 0, linear, 0.2) == pytest.approx(linear(0, 8))  # never fewer than the roots
    knee = _flat_then_linear(0.002, 1e-4, 64)  # a GPU below its knee: the same bits as d levels
    assert draft_seconds(3, 8, 2, 0, knee, l3) == 3 * knee(0, 16)


def test_the_slo_shape_reads_each_request_s_own_chain_rate() -> None:
    import numpy as np

    from adaserve.engine.speculation.adaptive import slo_shape

    kw = _slo_costs()
    base, rate = np.zeros(8), np.zeros(8)
    base[0], rate[0] = 2.0, 1 / 0.030  # owes 2 tokens at 30 ms: depth 5 at the batch's 0.8 (the test above)
    alphas = np.full(8, 0.8)
    assert slo_shape(8, base=base, rate=rate, alphas=alphas, **kw) == 5
    alphas[0] = 0.95  # its own text is predictable: 3 tokens reach 3.71 against the 3.15 it needs
    assert slo_shape(8, base=base, rate=rate, alphas=alphas, **kw) == 3
    alphas[0] = 0.6  # and where it is not, no depth serves it: goodput's shape, the depth without any SLO
    assert slo_shape(8, base=base, rate=rate, alphas=alphas, **kw) == slo_shape(
        8, base=np.zeros(8), rate=np.zeros(8), alphas=alphas, **kw) < 3


def test_a_request_s_chain_rate_is_its_latest_acceptance_shrunk_towards_the_batch() -> None:
    import numpy as np

    from adaserve.engine.speculation.adaptive import REQUEST_WINDOW, recent_ratios, request_alphas

    # verifications of the root alone propose nothing and are skipped; a ratio is accepted / (verified - 1)
    assert recent_ratios([0, 2, 0, 4], [1, 5, 1, 5]) == (0.5 + 1.0, 2)
    assert recent_ratios([], []) == (0.0, 0)
    many = recent_ratios([4] * 20 + [0] * REQUEST_WINDOW, [5] * (20 + REQUEST_WINDOW))
    assert many == (0.0, REQUEST_WINDOW)  # only the latest window counts
    alphas = request_alphas(np.array([[0.0, 0], [8.0, 8], [0.0, 8]]), 0.7)
    assert alphas[0] == 0.7  # nothing seen: the batch's rate
    assert 0.7 < alphas[1] < 1.0 and 0.0 < alphas[2] < 0.7


def test_a_beam_width_is_priced_at_what_its_own_trees_showed_once_they_did() -> None:
    from adaserve.engine.speculation.adaptive import MAX_ALPHA, MIN_WIDTH_SAMPLES, WidthAcceptance, beam_alpha

    rates = (0.8, 0.25, 0.1)
    # the ranks' sum saturates: widths 2 and 3 look alike to it
    assert beam_alpha(2, rates) == beam_alpha(3, rates) == MAX_ALPHA
    widths = WidthAcceptance()
    for _ in range(MIN_WIDTH_SAMPLES - 1):
        widths.observe(2, accepted=6, rejections=4)  # 2-wide trees: 6 accepted, 4 paths stopped by a rejection
    assert widths.alphas() == {}  # too few iterations yet: the sum still prices width 2
    widths.observe(2, accepted=6, rejections=4)
    widths.observe(0, accepted=5, rejections=5)  # plain iterations are nobody's width
    measured = widths.alphas()
    assert measured == {2: 0.6}
    assert beam_alpha(2, rates, measured) == 0.6 and beam_alpha(3, rates, measured) == MAX_ALPHA


def test_the_policy_prices_its_width_at_what_its_trees_showed() -> None:
    from adaserve.engine.speculation.adaptive import MIN_WIDTH_SAMPLES, AdaptiveConfig
    from adaserve.engine.speculation.policies import AdaServe, BatchView

    # drafting costs a little per level: the depth follows the width's alpha
    costs = {"predict_target": _flat_then_linear(0.025, 1e-4, 512),
             "predict_draft": _flat_then_linear(0.004, 1e-5, 256)}
    policy = AdaServe(adaptive=AdaptiveConfig(d_min=0, d_max=4, w_max=2, depth_rule="goodput"))
    view = BatchView(n_active=8, n_context=0, budget=128, rank_rates=lambda w: (0.8, 0.25)[:w], **costs)
    first = policy.tree_shape(view)
    assert first is not None and (first.depth, first.width) == (4, 2)  # the ranks' sum: 0.99 per level
    for _ in range(MIN_WIDTH_SAMPLES):  # its trees accept little: as many paths stop as tokens are accepted
        policy.observe_paths(accepted=8, rejections=8)
    after = policy.tree_shape(view)
    assert after is not None and after.width == 2 and after.depth < first.depth


def test_host_time_priced_beside_the_forwards_deepens_the_tree_or_stops_it() -> None:
    """H(d, n), the iteration's host time outside the forwards (cost.host_cost): paid once per iteration, it makes
    deeper trees (more tokens for it) worth more; where a tree's host time dwarfs plain decoding's, plain wins."""
    from adaserve.engine.speculation.adaptive import goodput_depth, goodput_shape, slo_shape

    kw = _slo_costs()
    assert goodput_shape(8, **kw) == 2 and goodput_shape(8, **kw, t_host=None) == 2
    depths = [goodput_shape(8, **kw, t_host=lambda d, n, h=h: h) for h in (0.0, 0.004, 0.008, 0.02)]
    assert depths == sorted(depths) and depths[-1] > depths[0]  # a larger fixed cost, a deeper tree
    spec_heavy = {"t_host": lambda d, n: 0.030 if d else 0.0005}
    assert goodput_shape(1, **kw, **spec_heavy) == 0
    base, rate = np.zeros(8), np.zeros(8)
    assert slo_shape(8, base=base, rate=rate, **kw, t_host=lambda d, n: 0.008) == goodput_shape(
        8, **kw, t_host=lambda d, n: 0.008)
    chain = {k: v for k, v in kw.items() if k not in ("rank_rates", "budget", "width")}
    assert goodput_depth(8, 1, alpha=0.8, **chain) == 2
    assert goodput_depth(8, 1, alpha=0.8, **chain, t_host=lambda d, n: 0.008) > 2
    assert goodput_depth(8, 1, alpha=0.8, **chain, **spec_heavy) == 0


def test_the_adaptive_policy_reads_the_host_time_its_view_gives() -> None:
    from adaserve.engine.speculation.policies import BatchView, make_policy

    costs = {"predict_target": _flat_then_linear(0.0023, 2.7e-4, 0), "predict_draft": _flat_then_linear(5e-4, 2e-4, 0)}
    policy = make_policy("adaserve")
    view = BatchView(n_active=1, n_context=128, budget=64, rank_rates=lambda w: (0.7, 0.1, 0.05), **costs)
    free = policy.tree_shape(view)
    heavy = policy.tree_shape(BatchView(n_active=1, n_context=128, budget=64, rank_rates=lambda w: (0.7, 0.1, 0.05),
                                        predict_host=lambda d, n: 0.02, **costs))
    assert free is not None and heavy is not None and heavy.depth > free.depth


@pytest.mark.parametrize(("ref", "bounds"), [
    ("artifact/llama-3.1-70b", (4, 3)), ("h200/llama-3.1-8b", (2, 3)), ("h100-80g/llama-3.1-8b", (4, 3)),
    ("a100-80g-tp4/llama-3.1-70b", (8, 4)), ("a100-80g-tp2/qwen2.5-32b", (8, 4)),
])
def test_the_shipped_accelerator_profiles_keep_their_beams(ref: str, bounds: tuple[int, int]) -> None:
    # the draft's levels counted in the width's bound (bounds_for_device) change no accelerator's bounds, so the
    # replay figures (the artifact's table) draft the trees they did
    from adaserve.bench.sim.device_model import load_profile_file
    from adaserve.bench.sim.profile import simulated_profile
    from adaserve.engine.build import adaptive_for

    a = adaptive_for(AdaptiveConfig(), simulated_profile(load_profile_file(ref)))
    assert (a.d_max, a.w_max) == bounds


def test_one_rejected_first_token_does_not_stop_a_fresh_beam() -> None:
    """Before rank rates are learnt a beam's depth is priced at the path acceptance, whose prior counts as
    PATH_PRIOR_WEIGHT levels tried: a fresh engine whose first drafted token is rejected keeps drafting (the
    maximum-likelihood estimate read alpha 0 and decoded plainly for PLAIN_STREAK iterations), and a run of
    rejections still turns speculation off."""
    from adaserve.engine.speculation.policies import PATH_PRIOR_WEIGHT, BatchView, make_policy

    costs = {"predict_target": _flat_then_linear(0.015, 1e-3, 2), "predict_draft": _flat_then_linear(0.0024, 1e-5, 8)}
    view = BatchView(n_active=1, n_context=256, budget=128, rank_rates=lambda w: None, **costs)
    policy = make_policy("adaserve")
    object.__setattr__(policy, "adaptive", AdaptiveConfig(d_min=0, d_max=4, w_max=2))
    assert policy.paths.prior_weight == PATH_PRIOR_WEIGHT
    assert policy.tree_shape(view) is not None  # the prior alone: a tree pays
    policy.observe_paths(0, 1)  # its first token rejected
    assert policy.paths.alpha == pytest.approx(0.7 * PATH_PRIOR_WEIGHT / (1 + PATH_PRIOR_WEIGHT))
    assert policy.tree_shape(view) is not None
    for _ in range(32):
        policy.observe_paths(0, 1)
    assert policy.tree_shape(view) is None  # the evidence outweighs the prior
    policy.paths.prior_weight = 0.0  # the plain estimate: one rejection already meant plain decoding
    policy.paths.clear()
    policy.observe_paths(0, 1)
    assert policy.paths.alpha == 0.0 and policy.tree_shape(view) is None
