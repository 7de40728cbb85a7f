"""Decoding policies: AdaServe and every baseline, on the same engine (docs/architecture.md §6).

A policy answers, each iteration: how to speculate (a ``TreeShape`` for the draft's beam search, or
None for no speculation), and which candidate nodes of each request to verify. Every policy is
lossless: the verification walk decides the output; a policy only changes how many tokens one target
forward confirms, and for whom.

    name            shape                               selection
    incremental     none                                root only
    chain:K         depth K, width 1                    the whole chain (no budget), like vLLM-Spec(K)
    specinfer       static expansion <1,1,3,1,1,1,1,1>  the whole tree (no budget)
    smartspec       chain, K by predicted goodput       the whole chain
    equal-greedy    adaptive (Eq. 8-9)                  budget split evenly, greedy per request
    global-greedy   adaptive                            globally highest path probability
    adaserve        adaptive                            Algorithm 2: SLO phase, then throughput phase
    beam:D,W        fixed depth D, width W              globally highest path probability

With several drafts, ``POLICY@SELECTOR`` also names how each request's draft is chosen
(draft_bandit.py: ``ucb``, ``eps``, ``length``, or ``dN`` for draft N alone); a policy without one uses
``ucb``. Spin's names are aliases: ``spin`` = ``chain:4@ucb``, ``spin-eps`` = ``chain:4@eps``,
``spin-length`` = ``chain:4@length`` (and ``spin@d1`` = ``chain:4@d1``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Protocol

import numpy as np

from adaserve.engine.model.tree import TokenTree
from adaserve.engine.speculation.adaptive import (
    AdaptiveConfig,
    PathAcceptance,
    WidthAcceptance,
    chain_rates,
    depth_width,
    goodput_depth,
    goodput_shape,
    request_alphas,
    slo_shape,
)
from adaserve.engine.speculation.selection import (
    SPECINFER_EXPANSION,
    select_adaserve,
    select_equal_greedy,
    select_global_greedy,
)
from adaserve.engine.speculation.smartspec import AcceptanceAverage, best_length


@dataclass(frozen=True)
class TreeShape:
    depth: int
    width: int = 1
    expansion: tuple[int, ...] | None = None  # static per-node fan-out (SpecInfer)
    # a plain streak's probe (``_Adaptive.tree_shape``): one request drafts, the one whose draft has the fewest
    # tokens to catch up (Engine picks it), the rest decode plainly
    probe: bool = False

    @property
    def max_nodes(self) -> int:
        if self.expansion is None:
            return 1 + self.depth * self.width
        total, level = 1, 1
        for k in self.expansion:
            level *= k
            total += level
        return total


@dataclass(frozen=True)
class BatchView:
    """What a policy sees before speculating."""

    n_active: int  # decoding requests this iteration
    n_context: int  # tokens already in the target KV across them
    budget: int  # B
    predict_target: Callable[[int, int], float]  # seconds for (N_context, N_batched)
    predict_draft: Callable[[int, int], float]
    prefill_tokens: int = 0  # prompt tokens riding in the same target forward
    # P(a rank-r sibling is accepted | its parent was), learnt (acceptance.RankAcceptance.rank_rates); None:
    # not learnt (draft values) or not yet, and the width is Eq. 9's
    rank_rates: Callable[[int], tuple[float, ...] | None] | None = None
    # per decoding request (base, rate) with A(r) = base + rate * t_iter (selection.requirement_line), [n, 2]; read
    # by the "slo" depth rule (adaptive.slo_shape); None: not given (the rule then prices goodput alone)
    slo_lines: np.ndarray | None = None
    # per decoding request, its latest chain acceptance (adaptive.recent_ratios: sum of accepted / proposed, count),
    # [n, 2]; the "slo" rule's per-request chain rates (adaptive.request_alphas); None: the batch's rate for all
    request_ratios: np.ndarray | None = None
    # host seconds of an iteration outside its forwards for (draft levels, decoding requests), 0 levels: plain
    # (cost.host_cost.HostCost); priced by the goodput and SLO shape rules beside the forwards. None: not priced
    predict_host: Callable[[int, int], float] | None = None


@dataclass(frozen=True)
class SelectionContext:
    budget: int  # tokens one verification may carry, roots included
    depth: int
    now_s: float
    t_iter_s: float  # predicted duration of this iteration
    min_value: float = 0.0  # the SLO phase takes no node valued below it (iteration_budget.token_price)


@dataclass(frozen=True)
class SelectionRecord:
    """One iteration's selection, for whoever measures it (the bench compares it with Algorithm 1)."""

    candidates: list[TokenTree]  # the draft's candidate tree per decoding request
    requirements: list[float]  # A(r) per request, as ``requirement`` computes it for this iteration
    selected: list[list[int]]  # the policy's choice: node indices per request
    ctx: SelectionContext


class Policy(Protocol):
    name: str

    @property
    def max_shape(self) -> TreeShape | None:
        """The largest tree this policy can build (sizes KV reservations); None if it never speculates."""

    def tree_shape(self, view: BatchView) -> TreeShape | None: ...

    def select(self, cands: list[TokenTree], needs: list[float], ctx: SelectionContext) -> list[list[int]]: ...

    def observe(self, accepted: int, proposed: int) -> None:
        """Feedback after verification: draft tokens accepted out of those proposed."""

    def observe_paths(self, accepted: int, rejections: int) -> None:
        """Feedback after verification: tokens accepted, and requests whose path stopped at a rejection."""


def _everything(cands: list[TokenTree]) -> list[list[int]]:
    return [list(range(c.size)) for c in cands]


class _NoFeedback:
    def observe(self, accepted: int, proposed: int) -> None:
        return None

    def observe_paths(self, accepted: int, rejections: int) -> None:
        return None


@dataclass(frozen=True)
class Incremental(_NoFeedback):
    name: str = "incremental"

    @property
    def max_shape(self) -> TreeShape | None:
        return None

    def tree_shape(self, view: BatchView) -> TreeShape | None:
        return None

    def select(self, cands: list[TokenTree], needs: list[float], ctx: SelectionContext) -> list[list[int]]:
        return [[0] for _ in cands]


@dataclass(frozen=True)
class Chain(_NoFeedback):
    k: int = 4
    name: str = "chain"

    def __post_init__(self) -> None:
        if self.k < 1:
            raise ValueError("chain:K needs K >= 1")

    @property
    def max_shape(self) -> TreeShape | None:
        return TreeShape(self.k, 1)

    def tree_shape(self, view: BatchView) -> TreeShape | None:
        return TreeShape(self.k, 1)

    def select(self, cands: list[TokenTree], needs: list[float], ctx: SelectionContext) -> list[list[int]]:
        return _everything(cands)


@dataclass(frozen=True)
class SpecInfer(_NoFeedback):
    expansion: tuple[int, ...] = SPECINFER_EXPANSION
    name: str = "specinfer"

    @property
    def max_shape(self) -> TreeShape | None:
        return TreeShape(len(self.expansion), expansion=self.expansion)

    def tree_shape(self, view: BatchView) -> TreeShape | None:
        return self.max_shape

    def select(self, cands: list[TokenTree], needs: list[float], ctx: SelectionContext) -> list[list[int]]:
        return _everything(cands)


@dataclass
class SmartSpec:
    max_k: int = 8
    acceptance: AcceptanceAverage = field(default_factory=AcceptanceAverage)
    name: str = "smartspec"

    @property
    def max_shape(self) -> TreeShape | None:
        return TreeShape(self.max_k, 1)

    def tree_shape(self, view: BatchView) -> TreeShape | None:
        k = best_length(n=max(1, view.n_active), n_context=view.n_context, alpha=self.acceptance.alpha,
                        max_k=self.max_k, t_target=view.predict_target, t_draft=view.predict_draft)
        return TreeShape(k, 1) if k > 0 else None

    def select(self, cands: list[TokenTree], needs: list[float], ctx: SelectionContext) -> list[list[int]]:
        return _everything(cands)

    def observe(self, accepted: int, proposed: int) -> None:
        self.acceptance.observe(accepted, proposed)

    def observe_paths(self, accepted: int, rejections: int) -> None:
        return None


@functools.lru_cache(maxsize=256)
def _with_budget(adaptive: AdaptiveConfig, budget: int) -> AdaptiveConfig:
    """``adaptive`` with B1 = this iteration's budget. Cached: a frozen config's checks, run again every
    iteration, cost a third of the shape rule's own time (issue 29's host time at 6 req/s)."""
    return replace(adaptive, b1=budget)


# plain iterations in a row after which the adaptive policies draft their best tree once (tree_shape)
PLAIN_STREAK = 32
# the beams' path acceptance before rank rates are learnt (the goodput depth's alpha): its prior 0.7 counts as this
# many draft levels tried, a lone request's 4-deep tree. Without it a fresh engine whose first drafted token was
# rejected read alpha 0, predicted plain decoding and held it for PLAIN_STREAK iterations (docs/benchmarks.md, "The
# cold start of a beam's path acceptance, fixed"); after four such iterations in a row the estimate is 0.35
PATH_PRIOR_WEIGHT = 4.0


@dataclass(frozen=True)
class _Adaptive(_NoFeedback):
    """Shared by the budgeted tree policies: width from Eq. 9; depth by predicted goodput (or Eq. 8). With the
    goodput rule and learnt sibling rates (``BatchView.rank_rates``), the depth at Eq. 9's width by predicted
    goodput (adaptive.goodput_shape; the "slo" rule: the most requests on their SLO first, adaptive.slo_shape),
    the width priced at what its own trees showed (adaptive.beam_alpha). Where every tree is a chain (w_max 1)
    both read the chain's rate from SmartSpec's window (adaptive.chain_rates), learnt rates or not.

    Why not the width by goodput too: the rule prices a level by whether the accepted path goes on, not by the
    better candidates a wider level gives the selection, so it drafted 2-wide trees where the artifact's table
    verifies 3-wide ones at the same price: adaserve+ours fell from 0.993 to 0.915 at Fig 10's 0.3 (0.952 with
    each width at its own measured rate) and from 0.987 to 0.851 at Fig 8's 4.72 req/s (replay, seed 0;
    docs/benchmarks.md). Where a wider tree does cost more to verify, ``bounds_for_device`` already narrows w_max
    (a CPU: chains)."""

    adaptive: AdaptiveConfig = field(default_factory=AdaptiveConfig)
    # mutable state in a frozen policy; the prior counts as PATH_PRIOR_WEIGHT levels tried (the cold start)
    paths: PathAcceptance = field(default_factory=lambda: PathAcceptance(prior_weight=PATH_PRIOR_WEIGHT))
    # SmartSpec's window of accepted / proposed: a chain's depth follows the latest iterations (adaptive.chain_rates)
    recent: AcceptanceAverage = field(default_factory=AcceptanceAverage)
    # each beam width's own path acceptance (adaptive.beam_alpha), and the width of the latest tree drafted
    widths: WidthAcceptance = field(default_factory=WidthAcceptance)
    _last_width: list[int] = field(default_factory=lambda: [0])
    _plain_streak: list[int] = field(default_factory=lambda: [0])  # iterations in a row decoded plainly

    @property
    def max_shape(self) -> TreeShape | None:
        return TreeShape(self.adaptive.d_max, self.adaptive.w_max)

    def tree_shape(self, view: BatchView) -> TreeShape | None:
        """The iteration's (d, w), or None: plain decoding, where the goodput rules predict no tree pays. After
        ``PLAIN_STREAK`` plain iterations in a row the best tree is drafted once anyway: a prediction made on
        costs and acceptance that plain decoding no longer updates cannot hold plain decoding forever (the demo
        pair's wall clock at 6 req/s: a backlog, plain decoding predicted, the backlog longer, no tree again).
        That probe drafts for one request (``TreeShape.probe``): the draft must first catch up on every token of
        the streak, and for a whole batch on a CPU that cost what the streak had saved (32 requests of the demo
        pair: two probes in 64 iterations made the mean iteration 1.5x a plain one; docs/benchmarks.md,
        "Twenty-fourth round"); one request's tree measures the acceptance as well."""
        d, w = self._shape(view, self.adaptive)
        probe = False
        if d > 0 or self.adaptive.d_min > 0:
            self._plain_streak[0] = 0
        else:
            self._plain_streak[0] += 1
            if self._plain_streak[0] >= PLAIN_STREAK:
                self._plain_streak[0] = 0
                d, w = self._shape(view, replace(self.adaptive, d_min=1))
                probe = view.n_active > 1
        self._last_width[0] = w if d > 0 else 0
        return TreeShape(d, w, probe=probe) if d > 0 else None

    def _shape(self, view: BatchView, adaptive: AdaptiveConfig) -> tuple[int, int]:
        cfg = _with_budget(adaptive, view.budget)
        d, w = depth_width(view.n_active, cfg)
        goodput = cfg.by_goodput  # the depth from [d_min, d_max] by goodput (or SLOs, then goodput), not Eq. 8's
        measured = None
        if goodput and cfg.w_max == 1:  # chains: rank 0 at the latest iterations' rate, from the first iteration
            rates: tuple[float, ...] | None = chain_rates(self.recent.alpha)
        else:
            rates = view.rank_rates(w) if view.rank_rates is not None and goodput else None
            # beams: Eq. 9's width (within bounds_for_device's, where verifying it costs about what a chain does),
            # priced at what trees of that width showed once they did
            measured = self.widths.alphas()
        if rates is not None:  # the depth at that width, its levels at their learnt (or measured) worth
            n = max(view.n_active, 1)
            lines = view.slo_lines if cfg.depth_rule == "slo" else None
            if lines is not None and len(lines):  # the most requests on target, then goodput
                own = (request_alphas(view.request_ratios, self.recent.alpha)
                       if view.request_ratios is not None else None)
                d = slo_shape(n, width=w, rank_rates=rates, budget=view.budget, d_min=cfg.d_min, d_max=cfg.d_max,
                              n_context=view.n_context, extra_tokens=view.prefill_tokens,
                              t_target=view.predict_target, t_draft=view.predict_draft, base=lines[:, 0],
                              rate=lines[:, 1], alphas=own, measured=measured, t_host=view.predict_host)
            else:
                d = goodput_shape(n, width=w, rank_rates=rates, budget=view.budget, d_min=cfg.d_min,
                                  d_max=cfg.d_max, n_context=view.n_context, extra_tokens=view.prefill_tokens,
                                  t_target=view.predict_target, t_draft=view.predict_draft, measured=measured,
                                  t_host=view.predict_host)
        elif goodput:
            d = goodput_depth(max(view.n_active, 1), w, alpha=self.paths.alpha, d_min=cfg.d_min, d_max=cfg.d_max,
                              n_context=view.n_context, extra_tokens=view.prefill_tokens,
                              t_target=view.predict_target, t_draft=view.predict_draft, t_host=view.predict_host)
        return d, w

    def observe(self, accepted: int, proposed: int) -> None:
        self.recent.observe(accepted, proposed)

    def observe_paths(self, accepted: int, rejections: int) -> None:
        self.paths.observe(accepted, rejections)
        self.widths.observe(self._last_width[0], accepted, rejections)


@dataclass(frozen=True)
class AdaServe(_Adaptive):
    n_max: int = 16  # per-request cap in the SLO phase, root included
    slo_order: str = "smallest-need"  # selection.SLO_ORDERS: whom the SLO phase serves first
    name: str = "adaserve"

    def select(self, cands: list[TokenTree], needs: list[float], ctx: SelectionContext) -> list[list[int]]:
        return select_adaserve(cands, needs, budget=ctx.budget, depth=ctx.depth, n_max=self.n_max,
                               order=self.slo_order, min_value=ctx.min_value)


@dataclass(frozen=True)
class EqualGreedy(_Adaptive):
    name: str = "equal-greedy"

    def select(self, cands: list[TokenTree], needs: list[float], ctx: SelectionContext) -> list[list[int]]:
        return select_equal_greedy(cands, budget=ctx.budget)


@dataclass(frozen=True)
class GlobalGreedy(_Adaptive):
    name: str = "global-greedy"

    def select(self, cands: list[TokenTree], needs: list[float], ctx: SelectionContext) -> list[list[int]]:
        return select_global_greedy(cands, budget=ctx.budget)


@dataclass(frozen=True)
class FixedBeam(_NoFeedback):
    depth: int = 4
    width: int = 2
    name: str = "beam"

    def __post_init__(self) -> None:
        if self.depth < 1 or self.width < 1:
            raise ValueError("beam:D,W needs D >= 1 and W >= 1")

    @property
    def max_shape(self) -> TreeShape | None:
        return TreeShape(self.depth, self.width)

    def tree_shape(self, view: BatchView) -> TreeShape | None:
        return self.max_shape

    def select(self, cands: list[TokenTree], needs: list[float], ctx: SelectionContext) -> list[list[int]]:
        return select_global_greedy(cands, budget=ctx.budget)


def reads_slo_lines(policy: Policy) -> bool:
    """Whether the policy's tree shape reads the requests' SLO lines (``BatchView.slo_lines``: the "slo" depth rule)."""
    return isinstance(policy, _Adaptive) and policy.adaptive.depth_rule == "slo"


def is_budgeted(policy: Policy) -> bool:
    """Whether the policy chooses within the budget B (the others verify their whole candidate trees)."""
    return isinstance(policy, _Adaptive | FixedBeam)


POLICY_NAMES = ("adaserve", "incremental", "chain:K", "specinfer", "smartspec", "equal-greedy", "global-greedy",
                "beam:D,W")
# Spin (docs/architecture.md §14): chain speculation, each request's draft chosen by a selector
POLICY_ALIASES = {"spin": "chain:4@ucb", "spin-eps": "chain:4@eps", "spin-length": "chain:4@length"}
DEFAULT_SELECTOR = "ucb"


def split_policy(spec: str) -> tuple[str, str | None]:
    """(tree policy, draft selector or None) of ``POLICY[@SELECTOR]``, Spin's aliases expanded."""
    head, _, selector = spec.partition("@")
    if head in POLICY_ALIASES:
        head, _, own = POLICY_ALIASES[head].partition("@")
        selector = selector or own
    return head, selector or None


class PolicyKnobs(Protocol):
    """What :func:`make_policy` reads of its configuration: ``engine.config.EngineConfig`` is one."""

    @property
    def adaptive(self) -> AdaptiveConfig: ...

    @property
    def n_max(self) -> int: ...

    @property
    def smartspec_max_k(self) -> int: ...

    @property
    def slo_order(self) -> str: ...


def make_policy(spec: str, cfg: PolicyKnobs | None = None) -> Policy:
    """A policy from its name (see the table above), with its knobs from ``cfg`` (each policy's own defaults
    without one); a ``@SELECTOR`` suffix is checked here and used by the engine (it only matters with
    several drafts)."""
    spec, selector = split_policy(spec)
    if selector is not None and not check_selector(selector):
        raise ValueError(f"bad draft selector {selector!r} in policy; expected ucb, eps, length or dN")
    name, _, arg = spec.partition(":")
    try:
        if name == "chain" and arg:
            return Chain(k=int(arg))
        if name == "beam":
            if not arg:
                return FixedBeam()
            d, w = (int(x) for x in arg.split(","))
            return FixedBeam(depth=d, width=w)
        if arg:
            raise ValueError
    except ValueError as e:
        detail = f": {e}" if str(e) else ""
        raise ValueError(f"bad policy {spec!r}{detail}; expected one of {', '.join(POLICY_NAMES)}, "
                         f"{', '.join(POLICY_ALIASES)}") from None
    simple: dict[str, Callable[[], Policy]] = {
        "adaserve": lambda: (AdaServe(adaptive=cfg.adaptive, n_max=cfg.n_max, slo_order=cfg.slo_order) if cfg
                             else AdaServe()),
        "incremental": Incremental,
        "specinfer": SpecInfer,
        "smartspec": lambda: SmartSpec(max_k=cfg.smartspec_max_k) if cfg else SmartSpec(),
        "equal-greedy": lambda: EqualGreedy(adaptive=cfg.adaptive) if cfg else EqualGreedy(),
        "global-greedy": lambda: GlobalGreedy(adaptive=cfg.adaptive) if cfg else GlobalGreedy(),
    }
    if name not in simple:
        raise ValueError(f"unknown policy {spec!r}; available: {', '.join(POLICY_NAMES)}, {', '.join(POLICY_ALIASES)}")
    return simple[name]()


def check_selector(name: str) -> bool:
    """Whether ``name`` is a draft selector (draft_bandit.make_selector checks N against the drafts)."""
    return name in ("ucb", "eps", "length") or (name.startswith("d") and name[1:].isdigit())
