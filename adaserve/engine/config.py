"""Every engine knob in one place: ``EngineConfig`` and the groups hanging off it.

One frozen object configures an engine, as nano-vllm's single ``Config`` does. Each group checks its
own fields when built and raises ValueError naming the field, so nothing downstream re-checks them.

    EngineConfig
      policy, budget, n_max, smartspec_max_k      what an iteration verifies, and for whom
      prefill_chunk, prefill_rule, max_batch      how much work one iteration takes on
      adaptive: AdaptiveConfig                    tree depth and width from the batch size (Eq. 8-9)
      attention, kv: KVCacheConfig                how a forward runs (read when runners are built)
      target_cost, draft_cost, initial_forward_s  predicting an iteration's duration
      history_len                                 how many per-step metrics are kept
      profiler: ProfilerConfig                    how start-up profiling measures
        knee: KneeConfig                          how B is read off the measured roofline

Not knobs: a request's own settings (``sampling.SamplingParams``), the model's shape (``model_config``),
and estimator constants nobody tunes (the online cost model's window, SmartSpec's acceptance window),
which stay with their estimators. docs/architecture.md §9 says where each group acts in an iteration.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from adaserve.engine.checks import is_int, is_real
from adaserve.engine.cost_model import CostModel

ATTENTION_BACKENDS = ("auto", "torch", "flashinfer")  # auto: flashinfer on CUDA when installed, else torch


def _at_least(owner: str, name: str, value: object, low: int) -> None:
    if not is_int(value) or value < low:  # type: ignore[operator]
        raise ValueError(f"{owner}.{name} must be an int >= {low}, got {value!r}")


def _positive(owner: str, name: str, value: object) -> None:
    if not is_real(value) or not math.isfinite(value) or value <= 0:  # type: ignore[arg-type, operator]
        raise ValueError(f"{owner}.{name} must be a finite number > 0, got {value!r}")


@dataclass(frozen=True)
class KVCacheConfig:
    """The paged KV cache of one model (kv_cache.py)."""

    page_size: int = 16  # tokens per page
    num_pages: int | None = None  # explicit size; else derived from memory_bytes
    memory_bytes: int = 256 * 2**20

    def __post_init__(self) -> None:
        _at_least("KVCacheConfig", "page_size", self.page_size, 1)
        if self.num_pages is not None:
            _at_least("KVCacheConfig", "num_pages", self.num_pages, 1)
        else:
            _at_least("KVCacheConfig", "memory_bytes", self.memory_bytes, 1)


@dataclass(frozen=True)
class AdaptiveConfig:
    """Bounds and constants of Eq. 8-9 (adaptive.py). The paper tunes c1, c2 by grid search and gives no
    values; the defaults below are starting points, meant to be overridden from the worker's profile.
    """

    # d never below 1: one draft step is cheap, and the SLO phase may still send only the root.
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
    # "eq8": the paper's Eq. 8, depth tied to the budget
    depth_rule: str = "goodput"

    def __post_init__(self) -> None:
        if not is_int(self.d_min) or self.d_min < 0 or not is_int(self.d_max) or self.d_max < self.d_min:
            raise ValueError(f"AdaptiveConfig: need 0 <= d_min <= d_max, got d_min={self.d_min}, d_max={self.d_max}")
        _at_least("AdaptiveConfig", "w_max", self.w_max, 1)
        _at_least("AdaptiveConfig", "b1", self.b1, 1)
        _at_least("AdaptiveConfig", "b2", self.b2, 1)
        _at_least("AdaptiveConfig", "c1", self.c1, 0)
        if not is_int(self.c2):
            raise ValueError(f"AdaptiveConfig.c2 must be an int, got {self.c2!r}")
        if self.depth_rule not in ("goodput", "eq8"):
            raise ValueError(f"AdaptiveConfig.depth_rule must be 'goodput' or 'eq8', got {self.depth_rule!r}")


@dataclass(frozen=True)
class KneeConfig:
    """How budget.choose_budget reads the roofline.

    criterion="elasticity" (default): B = the last n before the first grid step whose log-log slope
    d log t / d log n exceeds ``max_elasticity``: past it, doubling the tokens per forward costs more
    than a sqrt(2) rise in latency, i.e. the forward has stopped being mostly fixed cost.
    criterion="latency": B = largest n with t(n) <= (1 + eps) * t(1).
    criterion="throughput": B = the n maximising n / t(n) subject to t(n) <= (1 + eps_max) * t(1); among n
    whose tokens/s is within ``throughput_tol`` (relative) of that maximum, the smallest is taken, since a
    roofline past its ridge has a flat tokens/s plateau on which more tokens only cost latency.
    smooth: apply the median-of-3 outlier filter (see budget.smooth_roofline); the monotone envelope is
    always applied.
    """

    eps: float = 0.1
    criterion: Literal["elasticity", "latency", "throughput"] = "elasticity"
    max_elasticity: float = 0.5
    eps_max: float = 0.5
    throughput_tol: float = 0.02
    smooth: bool = True

    def __post_init__(self) -> None:
        for name in ("eps", "eps_max", "throughput_tol", "max_elasticity"):
            v = getattr(self, name)
            if not is_real(v) or not math.isfinite(v) or v < 0:
                raise ValueError(f"KneeConfig.{name} must be a finite number >= 0, got {v!r}")
        if self.throughput_tol >= 1:
            raise ValueError(f"KneeConfig.throughput_tol must be < 1, got {self.throughput_tol!r}")
        if self.criterion not in ("elasticity", "latency", "throughput"):
            raise ValueError(
                f"KneeConfig.criterion must be 'elasticity', 'latency' or 'throughput': {self.criterion!r}")
        if not isinstance(self.smooth, bool):
            raise ValueError(f"KneeConfig.smooth must be a bool, got {self.smooth!r}")


@dataclass(frozen=True)
class ProfilerConfig:
    """How profiler.py measures the roofline and the cost-model samples at start-up."""

    max_tokens: int | None = None  # largest n; default 1024 on CUDA, 256 on CPU (memory and time)
    context: int = 256  # representative context length per request for the roofline
    fit_contexts: tuple[int, ...] = (64, 256)  # contexts sampled for the cost-model fit
    repeats: int = 5
    warmup: int = 2
    knee: KneeConfig = field(default_factory=KneeConfig)

    def __post_init__(self) -> None:
        if self.max_tokens is not None:
            _at_least("ProfilerConfig", "max_tokens", self.max_tokens, 1)
        _at_least("ProfilerConfig", "context", self.context, 1)
        if not self.fit_contexts:
            raise ValueError("ProfilerConfig.fit_contexts must name at least one context length")
        for c in self.fit_contexts:
            _at_least("ProfilerConfig", "fit_contexts", c, 1)
        _at_least("ProfilerConfig", "repeats", self.repeats, 1)
        _at_least("ProfilerConfig", "warmup", self.warmup, 0)


BUDGET_RULES = ("goodput", "knee")
PREFILL_RULES = ("fixed", "slo")


@dataclass(frozen=True)
class MultiDraftConfig:
    """Several drafts (multi_draft.py, draft_bandit.py); ignored with one draft."""

    slot_iters: int = 4  # a request's verifications per draft slot: how often its draft may change
    # the profiled forward cost of the drafts after the first (``EngineConfig.draft_cost`` is the first's);
    # a draft without one learns its cost online
    extra_costs: tuple[CostModel, ...] = ()

    def __post_init__(self) -> None:
        _at_least("MultiDraftConfig", "slot_iters", self.slot_iters, 1)
        if not all(isinstance(c, CostModel) for c in self.extra_costs):
            raise ValueError("MultiDraftConfig.extra_costs must hold CostModels")


@dataclass(frozen=True)
class EngineConfig:
    """One engine's configuration. ``build.build_engine`` fills ``budget`` and the costs from the profile."""

    # ---- what an iteration verifies (policies.py) ----
    policy: str = "adaserve"  # a name from policies.POLICY_NAMES, e.g. "adaserve", "chain:4", "beam:4,2"
    budget: int = 64  # B: tokens per verification, roots included; the profiler's knee when profiled
    # "goodput": B is a floor, raised each iteration while verifying more raises expected tokens per
    # second (iteration_budget.py); "knee": B exactly, every iteration
    budget_rule: str = "goodput"
    # what a drafted node is worth to selection: "learned" (acceptance by sibling rank, learnt from
    # verification, acceptance.py) or "draft" (the draft's own path probability, as the paper)
    node_value: str = "learned"
    n_max: int = 16  # AdaServe: the most nodes (root included) one request takes in the SLO phase
    smartspec_max_k: int = 8  # SmartSpec: the longest chain it may choose
    adaptive: AdaptiveConfig = field(default_factory=AdaptiveConfig)

    # ---- how much an iteration takes on (engine.py) ----
    prefill_chunk: int = 256  # prompt tokens per step across requests (chunked prefill)
    # "fixed": prefill_chunk every iteration; "slo": the largest of prefill_chunk, /2, ... down to
    # prefill_min_chunk with which the decoding requests that can meet their TPOT SLO still do
    # (prefill_chunk.py); a scheduler setting, the same for every policy; "fixed" is the behaviour before it
    prefill_rule: str = "fixed"
    prefill_min_chunk: int = 32
    max_batch: int = 64  # requests admitted at once

    # ---- how a forward runs (runner.py, kv_cache.py, attention/) ----
    attention: str = "auto"  # one of ATTENTION_BACKENDS
    kv: KVCacheConfig = field(default_factory=KVCacheConfig)

    # ---- predicting an iteration's duration (timing.py) ----
    target_cost: CostModel | None = None  # profiled T_fwd of the target; learnt online when None
    draft_cost: CostModel | None = None
    drafts: MultiDraftConfig = field(default_factory=MultiDraftConfig)
    initial_forward_s: float = 0.02  # flat guess for an unprofiled forward, until measurements arrive

    history_len: int = 1024  # recent StepMetrics kept; totals are kept for the whole run
    profiler: ProfilerConfig = field(default_factory=ProfilerConfig)

    def __post_init__(self) -> None:
        _at_least("EngineConfig", "budget", self.budget, 1)
        if self.node_value not in ("learned", "draft"):
            raise ValueError(f"EngineConfig.node_value must be 'learned' or 'draft', got {self.node_value!r}")
        if self.budget_rule not in BUDGET_RULES:
            raise ValueError(f"EngineConfig.budget_rule must be one of {', '.join(BUDGET_RULES)}, "
                             f"got {self.budget_rule!r}")
        _at_least("EngineConfig", "n_max", self.n_max, 1)
        _at_least("EngineConfig", "smartspec_max_k", self.smartspec_max_k, 1)
        _at_least("EngineConfig", "prefill_chunk", self.prefill_chunk, 1)
        if self.prefill_rule not in PREFILL_RULES:
            raise ValueError(f"EngineConfig.prefill_rule must be one of {', '.join(PREFILL_RULES)}, "
                             f"got {self.prefill_rule!r}")
        _at_least("EngineConfig", "prefill_min_chunk", self.prefill_min_chunk, 1)  # capped at prefill_chunk
        _at_least("EngineConfig", "max_batch", self.max_batch, 1)
        _at_least("EngineConfig", "history_len", self.history_len, 1)
        _positive("EngineConfig", "initial_forward_s", self.initial_forward_s)
        if self.attention not in ATTENTION_BACKENDS:
            raise ValueError(f"EngineConfig.attention must be one of {', '.join(ATTENTION_BACKENDS)}, "
                             f"got {self.attention!r}")
        for name in ("target_cost", "draft_cost"):
            v = getattr(self, name)
            if v is not None and not isinstance(v, CostModel):
                raise ValueError(f"EngineConfig.{name} must be a CostModel or None, got {type(v).__name__}")
        # The policy name is checked where the policy is built from this config (policies.make_policy, called
        # by Engine and, before any model loads, by build_engine): policies import this module, not back.
