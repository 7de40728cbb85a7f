"""Adaptive speculation shape: beam-search depth d and width w from the number of active requests
(AdaServe section 5.2, Eq. 8-9). Busy batches get shallow, narrow trees; idle ones deep, wide trees.
The bounds and constants are ``AdaptiveConfig``; ``speculation_floor`` is the least budget they need.
Where the shape is priced (measured costs), ``goodput_shape`` picks the depth with the most expected tokens per
second and ``slo_shape`` the one keeping the most requests on their TPOT SLO, then goodput.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from adaserve.engine.checks import at_least, is_int
from adaserve.engine.speculation.smartspec import expected_emitted

DEPTH_RULES = ("goodput", "slo", "eq8")


@dataclass(frozen=True)
class AdaptiveConfig:
    """Bounds and constants of Eq. 8-9 (adaptive.py). The paper tunes c1, c2 by grid search and gives no
    values; the defaults below are starting points, meant to be overridden from the worker's profile.
    """

    # d never below 1 by default: one draft step is cheap, and the SLO phase may still send only the root.
    # d_min = 0 lets the goodput rules (goodput_depth, goodput_shape) choose plain decoding when no tree is
    # predicted to emit more tokens per second than one token per request: ``bounds_for_device`` sets it
    # where the costs are measured (issue 35: int4 on a CPU, where verifying costs about linearly in tokens,
    # halved the throughput of 8 requests with speculation). Unmeasured costs (a flat guess) keep 1.
    d_min: int = 1
    # Every extra level costs a full draft forward before verification can start. With the demo pair on
    # a CPU (draft only ~4.6x cheaper than the target) d_max=8, w_max=4 lost to chain:4 on SLO attainment
    # (0.54 vs 0.75 at 2.25 req/s) while d_max=4, w_max=2 reached 0.83 (docs/benchmarks.md). A GPU with
    # a cheaper draft step can afford deeper trees: raise these there (SpecInfer's static tree is 8 deep).
    d_max: int = 4
    w_max: int = 2
    # B1: verification tokens per iteration, i.e. the profiled budget B (section 5; AdaServe measures
    # 156 on A100). B1 / (n + c1) is each request's share of the verify budget, and d = share - 1 leaves
    # room for the root, so drafted depth stays within what selection can afford to verify. The budgeted
    # policies replace it with the engine's budget every iteration.
    b1: int = 128
    # B2: draft tokens per beam-search step (n * w <= B2 + c2 * n): small enough that steps 2..d stay
    # memory-bound on the draft and the fixed [n*w] shapes are cheap to graph-capture.
    b2: int = 32
    c1: int = 1  # > 0 so n + c1 never hits zero, and one request never claims the whole budget
    c2: int = 0
    # "goodput": depth by predicted tokens per second (adaptive.goodput_depth), width by Eq. 9;
    # "slo": as "goodput", but where the shape is chosen from rates (chains, learnt sibling rates) the shape
    # keeping the most requests on their TPOT SLO first, then goodput (adaptive.slo_shape). The default: on the
    # demo pair at 10 req/s it kept 0.035 more requests on target than "goodput" over 20 paired seeds
    # (docs/benchmarks.md, issue 29's wall clock);
    # "eq8": the paper's Eq. 8, depth tied to the budget
    depth_rule: str = "slo"

    def __post_init__(self) -> None:
        if not is_int(self.d_min) or self.d_min < 0 or not is_int(self.d_max) or self.d_max < self.d_min:
            raise ValueError(f"AdaptiveConfig: need 0 <= d_min <= d_max, got d_min={self.d_min}, d_max={self.d_max}")
        at_least("AdaptiveConfig", "w_max", self.w_max, 1)
        at_least("AdaptiveConfig", "b1", self.b1, 1)
        at_least("AdaptiveConfig", "b2", self.b2, 1)
        at_least("AdaptiveConfig", "c1", self.c1, 0)
        if not is_int(self.c2):
            raise ValueError(f"AdaptiveConfig.c2 must be an int, got {self.c2!r}")
        if self.depth_rule not in DEPTH_RULES:
            raise ValueError(f"AdaptiveConfig.depth_rule must be one of {', '.join(DEPTH_RULES)}, "
                             f"got {self.depth_rule!r}")

    @property
    def by_goodput(self) -> bool:
        """Whether the depth comes from predicted tokens per second ("goodput", and "slo", which prices the same
        shapes), not from Eq. 8."""
        return self.depth_rule != "eq8"


def speculation_floor(adaptive: AdaptiveConfig | None = None) -> int:
    """The least B the engine may run with: what one request needs to speculate at full size.

        floor = max(1 + d_max * w_max, (d_max + 1) * (1 + c1))

    1 + d_max * w_max is the largest tree one request can verify under the adaptive policies: beam
    search keeps at most w_max beams at each of at most d_max levels under one root (Eq. 8-9), and a
    budgeted policy (adaserve, equal-greedy, global-greedy) verifies at most B tokens per iteration over
    the whole batch. (d_max + 1) * (1 + c1) is the B at which Eq. 8, with B1 = B, lets a lone request
    (n = 1) draft d_max levels: d = floor(B / (1 + c1)) - 1.

    Why a floor at all: a knee below it means even a lone request, the cheapest batch there is, cannot
    have its tree verified. A busy machine once timed a table whose knee was B = 2, and adaserve then
    verified the root and one drafted token per iteration (0.15 accepted per verification) while chain:4,
    which ignores B, won every run. A tree of 1 + d_max * w_max tokens is a fraction of a forward's cost
    wherever drafting that tree pays at all, which is what the bounds are chosen for. Nothing else in the
    engine needs more: the policies that ignore B (chain, specinfer, smartspec) are unaffected, and the
    engine already lifts B to the number of roots, max(B, n), for a large batch.
    """
    a = AdaptiveConfig() if adaptive is None else adaptive
    return max(1 + a.d_max * a.w_max, (a.d_max + 1) * (1 + a.c1))


def depth_width(n_active: int, cfg: AdaptiveConfig) -> tuple[int, int]:
    """(d, w) for ``n_active`` requests:
        d = clip(floor(B1 / (n + c1)) - 1, Dmin, Dmax)     (Eq. 8)
        w = clip(floor(B2 / n) + c2, 1, Wmax)              (Eq. 9)
    n = 0 (nothing running) is treated as n = 1: the shape a lone new request would get.
    """
    if n_active < 0:
        raise ValueError(f"n_active must be >= 0, got {n_active}")
    n = max(n_active, 1)
    d = min(max(cfg.b1 // (n + cfg.c1) - 1, cfg.d_min), cfg.d_max)
    w = min(max(cfg.b2 // n + cfg.c2, 1), cfg.w_max)
    return d, w


# a beam wider than a chain only where its iteration (draft levels and verification) costs at most this much more
# than the chain's of the same depth (bounds_for_device)
WIDTH_TOLERANCE = 0.05


def bounds_for_device(cfg: AdaptiveConfig, *, t_target_s: float, t_draft_s: float, draft_budget: int,
                      t_verify: Callable[[int], float] | None = None,
                      t_draft_at: Callable[[int], float] | None = None) -> AdaptiveConfig:
    """``cfg`` with d_max, w_max and B2 set from the profiled costs instead of CPU-tuned constants.

    r = t_target(1) / t_draft(1): how many draft forwards one target forward buys.
        d_max = clip(round(0.75 * r), 2, 8)   the d draft steps before verification stay under ~3/4 of
                                              the target forward (8: SpecInfer's depth). r = 5.6 for the
                                              default pair on a CPU gives 4, the depth measured best there.
        w_max = 4 if r >= 10,                 a wide beam needs a draft cheap enough to run its w x tokens:
                3 if B2 >= 64, else 2         a draft whose knee holds 64 tokens (memory-bound: an
                                              accelerator) runs 3 beams for ~20 requests at the price of one;
                                              3 is the paper's width for its own pair (a 5 ms 1B draft step
                                              against a 30 ms 70B forward). Replayed on that table with the
                                              demo pair's agreement (issue 29), width 3 raised accepted tokens
                                              per verification from 2.3 to 2.6, and the real engine agreed
                                              (2.19 -> 2.36 on the replay's cross-check workload;
                                              scripts/replay-tree-crosscheck.py). A CPU's
                                              draft is compute-bound and its knee small: it keeps 2.
        B2    = the draft's own knee          draft tokens per beam step that still cost about one token
        d_min = 0 with the goodput depth rule  plain decoding where no tree is predicted to pay (measured costs)
        d_max = CHAIN_DEPTH (8) where the      chains whose length the goodput rule picks from the latest
                width bound is 1 (goodput rule)  iterations' acceptance, as SmartSpec's (``chain_rates``): the
                                              draft-ratio bound above capped the demo CPU pair at 2 (r = 3.2),
                                              where SmartSpec's 8-token chains emitted a token every 2.1 ms
                                              against 3.7 ms for 2-token ones (issue 29's wall clock; a trace in
                                              docs/results/shape-trace-041ca92-smartspec-rate4-seed0.json)

    ``t_verify(k)``: the target's measured forward at k tokens (the profile's table); ``t_draft_at(k)`` the
    draft's. The width then also shrinks until the beam's whole iteration costs at most WIDTH_TOLERANCE more
    than the chain's of the same depth, the draft's levels included:

        iteration(w) = t_draft(1) + (d_max - 1) t_draft(w) + t_verify(1 + d_max w)   (catch-up, levels, verify)
        w_max        = the widest w with iteration(w) <= (1 + WIDTH_TOLERANCE) iteration(1)

    A beam is worth its siblings where the models are flat, as below an accelerator's knee (the artifact's
    table: 13 tokens cost what 5 do, width 3 stays), not where each drafted and verified token costs compute.
    On this CPU the demo target's 9 tokens cost 1.3x its 5, and with w_max 3 the width rule drafted 2-wide
    beams in nearly every iteration at 1 req/s with a worse TPOT than chain:4's (the sum of the ranks' rates
    overvalues a beam and the straight-line cost model underprices its verification: docs/benchmarks.md,
    issue 29's wall clock). The draft counts too, and the tolerance is tight, because the table prices a tree
    as a chain of as many tokens: on a 2-core Xeon with AMX the profile put 7 verified tokens at 1.06x the price
    of 4 (2-wide beams, verification alone), the whole iteration at 1.098x, and the 2-wide trees then ran 28%
    longer than chains of the same depth (8.2 against 6.4 ms at one request: the tree mask, the second beam's
    draft rows, the levels' planning), which lost to chains (docs/benchmarks.md, issue 29's wall clock).
    """
    if not (t_target_s > 0 and t_draft_s > 0):
        return cfg
    r = t_target_s / t_draft_s
    d_max = min(max(round(0.75 * r), 2), 8)
    w_max = 4 if r >= 10 else 3 if draft_budget >= 64 else 2
    if t_verify is not None:
        draft = t_draft_at if t_draft_at is not None else (lambda k: t_draft_s)  # no draft table: a flat draft

        def iteration(w: int) -> float:  # the catch-up, d_max - 1 levels of w beams, the verification
            return draft(1) + (d_max - 1) * draft(w) + t_verify(1 + d_max * w)

        while w_max > 1 and iteration(w_max) > (1 + WIDTH_TOLERANCE) * iteration(1):
            w_max -= 1
    if w_max == 1 and cfg.by_goodput:
        d_max = CHAIN_DEPTH  # chains, their length by goodput: SmartSpec's bound (``chain_rates``)
    # measured costs may also say no tree pays: the goodput depth rule may then choose plain decoding (d = 0)
    d_min = 0 if cfg.by_goodput else cfg.d_min
    return replace(cfg, d_min=d_min, d_max=max(d_max, cfg.d_min), w_max=w_max, b2=max(1, draft_budget))


# the most a level's continuation probability may be taken to be (l(alpha, d) stays finite, d still matters)
MAX_ALPHA = 0.99
# the deepest chain the goodput rule may draft where every tree is a chain (SmartSpec's proposal length bound, and
# SpecInfer's depth)
CHAIN_DEPTH = 8


def chain_rates(recent: float) -> tuple[float, ...]:
    """The sibling rates ``goodput_shape`` reads for a chain: rank 0's alone (a chain has no rank 1), and that one
    ``recent``, SmartSpec's acceptance, the mean of accepted / proposed over the latest iterations
    (``smartspec.AcceptanceAverage``, its prior before the first), whether or not rank rates were learnt.

    The learnt rates are counted over hundreds of trees; they say what a child is worth on average, not how
    predictable the text being written is now, which changes within a request (boilerplate, then a name). On the
    demo pair at 4 req/s (issue 29's wall clock, docs/benchmarks.md) the long-run rate held every chain at 2
    tokens, decoding at 2.25 ms per token, SmartSpec's window 2.12: it drafted 1-8 tokens and emitted 8.3 of 9
    in its 8-token chains; with this rule its shapes are SmartSpec's, at 2.19 (one trace each, within the ~5%
    run-to-run spread: docs/results/shape-trace-*-rate4-seed0.json). The geometric
    estimate over the same window, accepted / (accepted + rejections), went deep too eagerly (6.2 of 9 emitted
    at 8, a scratch run); SmartSpec's ratio, which a short accepted prefix of a long chain pulls down at once,
    does not. Before the rank rates are learnt the window stands alone: the geometric estimate, which has no
    prior, read one rejected first token as alpha 0 and decoded plainly for ``policies.PLAIN_STREAK`` iterations
    at a time: 55 of a fresh engine's first 63 iterations on the demo pair at 1 req/s in one trace
    (docs/results/shape-trace-fe393e2-rate1-seed0.json). For chains only (``policies._Adaptive``): in a beam only
    one of a level's w nodes can be accepted, so the ratio would say little about a path."""
    return (float(recent),)


def beam_alpha(w: int, rank_rates: Sequence[float], measured: Mapping[int, float] | None = None) -> float:
    """alpha(w), P(the accepted path goes one level deeper) in a beam of width w: what trees of that width showed
    (``measured``, ``WidthAcceptance.alphas``), else the sum of the ranks' rates, capped at MAX_ALPHA.

    The sum is exact for w children of one node; a beam keeps the w best paths of a level, often all below the
    top child, so the sum overrates it, and at the cap every width looks alike. On the artifact's table (replay,
    4.72 req/s) the learnt rates summed past the cap at width 2, the rule drafted 2-wide trees in 2947 of 3321
    iterations, and accepted 2.27 tokens per request where 3-wide ones had accepted 2.51 (attainment 0.851
    against 0.987; docs/benchmarks.md). A width's own trees say what it is worth; until they have, the sum."""
    if measured is not None and w in measured:
        return min(measured[w], MAX_ALPHA)
    return min(float(sum(rank_rates[:w])), MAX_ALPHA)


def _priced_depths(n: int, *, width: int, rank_rates: Sequence[float], budget: int, d_min: int, d_max: int,
                   n_context: int, extra_tokens: int, t_target: Callable[[int, int], float],
                   t_draft: Callable[[int, int], float], measured: Mapping[int, float] | None = None,
                   t_host: Callable[[int, int], float] | None = None) -> Iterator[tuple[int, float, float]]:
    """Every depth ``goodput_shape`` and ``slo_shape`` weigh at ``width``, as (d, seconds, tokens one request is
    expected to emit), shallowest first; plain decoding (d = 0) first of all where ``d_min`` is 0. ``t_host``:
    the iteration's host seconds outside the forwards for (d, n) (cost.host_cost), added to each; None: 0."""
    if width < 1 or len(rank_rates) < width:
        raise ValueError(f"a shape rule needs a rate for each of {width} sibling ranks, got {len(rank_rates)}")
    host = (lambda d: 0.0) if t_host is None else (lambda d: t_host(d, n))
    if d_min == 0:
        yield 0, t_target(n_context, n + extra_tokens) + host(0), 1.0
    alpha = beam_alpha(width, rank_rates, measured)
    step = t_draft(n_context, n * width)  # one beam level: the same for every depth
    for d in range(max(d_min, 1), max(d_max, 1) + 1):
        verified = min(n * (1 + d * width), max(budget, n * (d + 1)))
        emitted = expected_emitted(alpha, d)
        draft = draft_seconds(d, n, width, n_context, t_draft, emitted, step=step)
        yield d, draft + t_target(n_context, verified + extra_tokens) + host(d), emitted


def draft_seconds(d: int, n: int, width: int, n_context: int, t_draft: Callable[[int, int], float],
                  emitted: float, *, step: float | None = None) -> float:
    """The draft's forwards for a tree ``d`` levels deep over ``n`` requests, in the steady state of that depth, as
    the beam search runs them (speculate.beam_search):

        T_draft(d) = T_draft(N_ctx, n * l) + (d - 1) * T_draft(N_ctx, n * w)

    The first forward feeds each request's tokens the draft has not seen, the root last: what the last iteration
    emitted, l of them per request (``emitted``: l(alpha, d) at this depth, so the steady state of drafting d
    levels); its logits pick level 1, and each later forward feeds a level's n * w nodes. A backlog (a new
    request's prompt, the tokens of plain iterations) is a one-off the rules leave out. Why l: pricing the first
    forward as a level (n * w, as the rules did) left out a chain's catch-up of 2-3 tokens a request; where a
    forward's cost grows with its tokens from the first (a CPU), the served policy's draft forwards ran 1.6-1.9x its
    prediction at 32 requests, and it drafted where plain decoding was faster (docs/benchmarks.md, "Twenty-fourth
    round"). Where both cost the same (below a GPU's knee) the sum is ``d * step``, bit for bit. ``step``: the
    level's seconds, when the caller has them. 0 for d = 0 (plain decoding: no draft forward)."""
    if d < 1:
        return 0.0
    level = t_draft(n_context, n * width) if step is None else step
    first = t_draft(n_context, max(n, round(n * emitted)))
    return d * level if first == level else first + (d - 1) * level


def goodput_shape(n: int, *, width: int, rank_rates: Sequence[float], budget: int, d_min: int, d_max: int,
                  n_context: int, extra_tokens: int, t_target: Callable[[int, int], float],
                  t_draft: Callable[[int, int], float], measured: Mapping[int, float] | None = None,
                  t_host: Callable[[int, int], float] | None = None) -> int:
    """The depth d of a tree ``width`` wide (Eq. 9's) with the most expected tokens per second, where a beam
    of w siblings is worth what the verified trees showed siblings are worth (0: plain decoding):

        alpha(w)    = min(sum of rank_rates[:w], MAX_ALPHA)   P(the path goes one level deeper) with w
                      candidates at a level: rank_rates[r] = P(the rank-r child is accepted | its parent was),
                      learnt from verification (acceptance.RankAcceptance.rank_rates); one child at most is
                      accepted, so the ranks' chances add; or, once trees of width w were verified, what
                      they showed (``measured``; ``beam_alpha``)
        verified    = min(n * (1 + d * w), max(B, n * (d + 1)))     the whole trees, up to the budget
        goodput     = n * l(alpha(w), d) / (T_draft(d) + T_target(N_ctx, verified + extra) + H(d, n))
                      T_draft(d): d draft forwards, the first feeding what d levels emit (``draft_seconds``)
                      H: the iteration's host time outside the forwards (``t_host``, cost.host_cost; 0 if None)

    The width is not chosen here: it once was (the widest of Eq. 9's by the same goodput), and on the artifact's
    table that drafted 2-wide trees where 3-wide ones verify at the same price (policies._Adaptive). Ties go to
    the shallower tree, and to plain decoding (where ``d_min`` is 0) when no tree is predicted to emit more tokens
    per second than one token per request.

    Why H: on a CPU an iteration's own host time (drafting's planning, selection, the verification walk) is as long
    as the target's forward, most of it paid once per iteration whatever the depth, so pricing the forwards alone
    made every tree look cheaper than it is by about that much and favoured shallow trees, each paying it again
    for fewer tokens (and trees over plain decoding, whose host time is a fraction of a tree's). The engine passes H
    only where ``EngineConfig.host_cost`` is on (off by default: a tie on an AVX2 VM, docs/benchmarks.md).
    """
    best_d, best = max(d_min, 1), -1.0
    for d, cost, emitted in _priced_depths(n, width=width, rank_rates=rank_rates, budget=budget, d_min=d_min,
                                           d_max=d_max, n_context=n_context, extra_tokens=extra_tokens,
                                           t_target=t_target, t_draft=t_draft, measured=measured, t_host=t_host):
        rate = n * emitted / max(cost, 1e-12)
        if rate > best * (1 + 1e-9):
            best_d, best = d, rate
    return best_d


def slo_shape(n: int, *, width: int, rank_rates: Sequence[float], budget: int, d_min: int, d_max: int,
              n_context: int, extra_tokens: int, t_target: Callable[[int, int], float],
              t_draft: Callable[[int, int], float], base: np.ndarray, rate: np.ndarray,
              alphas: np.ndarray | None = None, measured: Mapping[int, float] | None = None,
              t_host: Callable[[int, int], float] | None = None) -> int:
    """The depth by the SLO rule: of ``goodput_shape``'s candidates, the one that keeps the most requests on
    their TPOT SLO, then the most expected tokens per second (Algorithm 2's order, SLO first, applied to the
    tree the draft builds, as ``iteration_budget.slo_budget`` applies it to B):

        T(d)      = T_draft(d) + T_target(N_ctx, verified + extra) + H(d, n)   (goodput_shape's)
        on_slo(d) = #{ r with an SLO : A_r(T(d)) <= l(alpha_r, d) }
                    A_r(T) = base_r + rate_r * T: what r must emit this iteration (selection.requirement_line)
        d         = argmax (on_slo, sum_r l(alpha_r, d) / T(d))

    alpha_r is the batch's alpha(w), or for chains with ``alphas`` each request's own rate (``request_alphas``):
    code continues more predictably than a summary, and the depth a coding request at a tight SLO needs is what its
    own acceptance says, not the batch's mean.

    Why: one depth serves the whole batch, and goodput alone picks the depth that suits the batch. On the demo
    pair at 6 req/s it picked 2-token chains in most iterations, where a coding request, at 1.2x the baseline's
    TPOT, needs more tokens per iteration than two drafted ones yield; chain:4, which drafts 4 whatever the
    batch, kept more coding requests on target (issue 29's wall clock, docs/benchmarks.md). The selection can
    only trim a tree, never deepen it: the depth must already hold what the tightest requests need. A deeper
    tree also lengthens the iteration, raising every A_r; the count weighs both. Requests a depth cannot keep on
    target do not pull it deeper; requests with slack pull it shallower only through goodput.
    ``base``, ``rate``: per request, 0 and 0 without an SLO (never counted).
    """
    slo = rate > 0
    own = None if alphas is None or width != 1 else np.minimum(alphas, MAX_ALPHA)
    priced = list(_priced_depths(n, width=width, rank_rates=rank_rates, budget=budget, d_min=d_min, d_max=d_max,
                                 n_context=n_context, extra_tokens=extra_tokens, t_target=t_target, t_draft=t_draft,
                                 measured=measured, t_host=t_host))
    if not priced:  # no depth in [d_min, d_max]
        return max(d_min, 1)
    depths = [d for d, _, _ in priced]
    if own is None and len(base) == 1:
        # a lone request: its count and goodput per depth over Python floats, the arrays' operations one by one
        # (the same bits; issue 30: a dozen numpy calls for one request's handful of depths)
        b, r = float(base[0]), float(rate[0])
        on_slo = [int(r > 0 and b + r * c <= e) for _, c, e in priced]
        goodput = [e / max(c, 1e-12) for _, c, e in priced]
    else:
        cost = np.array([c for _, c, _ in priced])  # [D]
        # [D, n]: l(alpha_r, d) per depth and request (smartspec.expected_emitted, alpha_r < 1), every depth's row
        # in one array (issue 30: the counts below are one op for all depths, not a few per depth)
        if own is None:
            each = np.repeat(np.array([e for _, _, e in priced])[:, None], len(base), axis=1)
        else:
            each = np.array([(1 - own ** (d + 1)) / (1 - own) for d in depths]).reshape(len(depths), len(base))
        # the count per depth: a bool sum along the rows (np.count_nonzero with an axis is numpy's Python layer)
        on_slo = np.add.reduce(slo & (base + rate * cost[:, None] <= each), axis=1).tolist()
        goodput = (each.sum(axis=1) / np.maximum(cost, 1e-12)).tolist()
    best_d, best = max(d_min, 1), (-1, -1.0)
    for d, count, rate_d in zip(depths, on_slo, goodput, strict=True):
        if count > best[0] or (count == best[0] and rate_d > best[1] * (1 + 1e-9)):
            best_d, best = d, (count, rate_d)
    return best_d


# a request's own chain rate: SmartSpec's accepted / proposed over its latest verifications, the batch's rate counting
# as this many of them (so a new request starts at the batch's rate and a few verifications move it)
REQUEST_WINDOW = 8
REQUEST_PRIOR_WEIGHT = 2.0


def recent_ratios(accepted: Sequence[int], verified: Sequence[int], window: int = REQUEST_WINDOW) -> tuple[float, int]:
    """(sum of accepted / proposed, how many) over a request's latest ``window`` verifications that proposed a
    token (``verified`` counts the tree's tokens, the root included)."""
    total, count = 0.0, 0
    for a, v in zip(reversed(accepted), reversed(verified), strict=False):
        if v > 1:
            total += min(1.0, a / (v - 1))
            count += 1
            if count == window:
                break
    return total, count


def request_alphas(ratios: np.ndarray, batch_alpha: float) -> np.ndarray:
    """Each request's chain rate from its ``recent_ratios`` rows [n, 2], shrunk towards ``batch_alpha``:
    (sum + w0 * batch) / (count + w0), w0 = REQUEST_PRIOR_WEIGHT."""
    return (ratios[:, 0] + REQUEST_PRIOR_WEIGHT * batch_alpha) / (ratios[:, 1] + REQUEST_PRIOR_WEIGHT)


@dataclass
class PathAcceptance:
    """alpha of a geometric model of how far down its tree a request's accepted path reaches.

    Each draft level is accepted with probability alpha until the first rejection; the maximum-likelihood
    alpha is accepted / (accepted + rejections) (a request whose whole path was accepted had no
    rejection). Summed over a window of recent iterations; ``prior`` until the first one.

    ``prior_weight`` > 0 shrinks the estimate towards ``prior`` as that many levels tried would:
    (accepted + w * prior) / (accepted + rejections + w). Without it one rejected first token reads as alpha 0
    (SmartSpec's window has the same guard, smartspec.AcceptanceAverage).
    """

    window: int = 32
    prior: float = 0.7
    prior_weight: float = 0.0
    samples: deque[tuple[int, int]] = field(default_factory=deque)  # read-only: observe and clear change it
    # the window's sums, kept as samples come and go (integers: exact); alpha is read every iteration (issue 30)
    _accepted: int = field(default=0, repr=False)
    _rejections: int = field(default=0, repr=False)

    @property
    def alpha(self) -> float:
        acc, trials = self._accepted, self._accepted + self._rejections
        if trials + self.prior_weight <= 0:
            return self.prior
        return (acc + self.prior_weight * self.prior) / (trials + self.prior_weight)

    def observe(self, accepted: int, rejections: int) -> None:
        if accepted + rejections <= 0:
            return
        self.samples.append((accepted, rejections))
        self._accepted += accepted
        self._rejections += rejections
        while len(self.samples) > self.window:
            a, r = self.samples.popleft()
            self._accepted -= a
            self._rejections -= r

    def clear(self) -> None:
        """Forget every sample: alpha is the prior again."""
        self.samples.clear()
        self._accepted = self._rejections = 0


# verified iterations of one width before its path acceptance replaces the ranks' sum (beam_alpha)
MIN_WIDTH_SAMPLES = 4


@dataclass
class WidthAcceptance:
    """``PathAcceptance`` per beam width: how far down the trees of each width the accepted paths reached, over
    that width's latest verified iterations (``beam_alpha``)."""

    window: int = 32
    by_width: dict[int, PathAcceptance] = field(default_factory=dict)

    def observe(self, width: int, accepted: int, rejections: int) -> None:
        if width < 1:
            return
        self.by_width.setdefault(width, PathAcceptance(window=self.window)).observe(accepted, rejections)

    def alphas(self) -> dict[int, float]:
        """alpha per width with at least MIN_WIDTH_SAMPLES iterations observed."""
        return {w: p.alpha for w, p in self.by_width.items() if len(p.samples) >= MIN_WIDTH_SAMPLES}


def goodput_depth(n: int, width: int, *, alpha: float, d_min: int, d_max: int, n_context: int,
                  extra_tokens: int, t_target: Callable[[int, int], float],
                  t_draft: Callable[[int, int], float], t_host: Callable[[int, int], float] | None = None) -> int:
    """The depth d in [max(d_min, 1), d_max] with the most expected tokens per second (SmartSpec's rule,
    for the best path of a beam tree), or 0 (plain decoding) where ``d_min`` is 0 and one token per request
    per forward is predicted to be at least as fast (``plain_rate``):

        goodput(d) = n * l(alpha, d) / (T_draft(d) + T_target(N_ctx, n * (d + 1) + extra) + H(d, n))

    with l(alpha, d) = (1 - alpha^(d+1)) / (1 - alpha) tokens per request (bonus included). Each beam
    step runs n * w draft tokens, the first forward the n * l tokens emitted (``draft_seconds``); verification
    is priced for the best path (the selection may verify more when those tokens pay, iteration_budget.py).
    ``extra``: prefill tokens in the same forward.
    Why not Eq. 8 alone: it ties depth to the budget, d = B / (n + c1) - 1, so as a backlog grows the
    trees shrink, fewer tokens are accepted per forward and the backlog grows faster; chain:4, which
    ignores B, kept up with a load that collapsed adaserve (docs/benchmarks.md).
    """
    best_d, best = max(d_min, 1), -1.0
    step = t_draft(n_context, n * width)  # one beam level: the same for every depth
    for d in range(max(d_min, 1), max(d_max, 1) + 1):
        emitted = expected_emitted(alpha, d)
        cost = draft_seconds(d, n, width, n_context, t_draft, emitted, step=step)
        cost += t_target(n_context, n * (d + 1) + extra_tokens)
        cost += 0.0 if t_host is None else t_host(d, n)
        rate = n * emitted / max(cost, 1e-12)
        if rate > best:
            best_d, best = d, rate
    return 0 if d_min == 0 and plain_rate(n, n_context, extra_tokens, t_target, t_host) >= best else best_d


def plain_rate(n: int, n_context: int, extra_tokens: int, t_target: Callable[[int, int], float],
               t_host: Callable[[int, int], float] | None = None) -> float:
    """Tokens per second without speculation: one token per request per target forward (d = 0), plus its host
    time where ``t_host`` is given."""
    host = 0.0 if t_host is None else t_host(0, n)
    return n / max(t_target(n_context, n + extra_tokens) + host, 1e-12)
