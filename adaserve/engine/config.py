"""Every engine knob under one object: ``EngineConfig`` and the groups hanging off it.

One frozen object configures an engine, as nano-vllm's single ``Config`` does. Each group is defined
beside the code it configures (so a subpackage never imports this module) and checks its own fields
when built, raising ValueError naming the field, so nothing downstream re-checks them.

    EngineConfig                                  (this module)
      policy, budget, n_max, smartspec_max_k      what an iteration verifies, and for whom
      prefill_chunk, prefill_rule, prefill_mode,  how much work one iteration takes on
      max_batch
      adaptive: AdaptiveConfig                    tree depth and width from the batch size (Eq. 8-9;
                                                  speculation/adaptive.py)
      attention, kv: KVCacheConfig, static_shapes how a forward runs (model/attention, kv_cache.py, static.py)
      prefix_caching                              reuse cached prompt prefixes' KV (kv_cache.py, prefix_cache.py)
      target_cost, draft_cost, initial_forward_s  predicting an iteration's duration
      drafts: MultiDraftConfig                    several drafts (this module; multi_draft.py)
      history_len                                 how many per-step metrics are kept
      profiler: ProfilerConfig                    how start-up profiling measures (cost/profiler.py)
        knee: KneeConfig                          how B is read off the measured roofline (cost/budget.py)

Not knobs: a request's own settings (``sampling.SamplingParams``), the model's shape (``model.config``),
and estimator constants nobody tunes (the online cost model's window, SmartSpec's acceptance window),
which stay with their estimators. docs/architecture.md §9 says where each group acts in an iteration.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from adaserve.engine.checks import at_least, positive
from adaserve.engine.cost.cost_model import CostModel
from adaserve.engine.cost.profiler import ProfilerConfig
from adaserve.engine.model.attention import ATTENTION_BACKENDS
from adaserve.engine.model.kv_cache import KVCacheConfig
from adaserve.engine.speculation.adaptive import AdaptiveConfig
from adaserve.engine.speculation.selection import SLO_ORDERS

BUDGET_RULES = ("goodput", "knee", "slo")
SLO_FLOORS = ("price", "none")
PREFILL_RULES = ("fixed", "slo")
PREFILL_MODES = ("mixed", "separate")


@dataclass(frozen=True)
class MultiDraftConfig:
    """Several drafts (multi_draft.py, draft_bandit.py); ignored with one draft."""

    slot_iters: int = 4  # a request's verifications per draft slot: how often its draft may change
    # the profiled forward cost of the drafts after the first (``EngineConfig.draft_cost`` is the first's);
    # a draft without one learns its cost online
    extra_costs: tuple[CostModel, ...] = ()

    def __post_init__(self) -> None:
        at_least("MultiDraftConfig", "slot_iters", self.slot_iters, 1)
        if not all(isinstance(c, CostModel) for c in self.extra_costs):
            raise ValueError("MultiDraftConfig.extra_costs must hold CostModels")


@dataclass(frozen=True)
class EngineConfig:
    """One engine's configuration. ``build.build_engine`` fills ``budget`` and the costs from the profile."""

    # ---- what an iteration verifies (policies.py) ----
    policy: str = "adaserve"  # a name from policies.POLICY_NAMES, e.g. "adaserve", "chain:4", "beam:4,2"
    budget: int = 64  # B: tokens per verification, roots included; the profiler's knee when profiled
    # "goodput": B is a floor, raised each iteration while verifying more raises expected tokens per
    # second (iteration_budget.py); "knee": B exactly, every iteration; "slo": the B that keeps the most
    # requests on their TPOT SLO, then the most tokens per second (iteration_budget.slo_budget)
    budget_rule: str = "goodput"
    # what a drafted node is worth to selection: "learned" (acceptance by sibling rank, learnt from
    # verification, acceptance.py) or "draft" (the draft's own path probability, as the paper)
    node_value: str = "learned"
    n_max: int = 16  # AdaServe: the most nodes (root included) one request takes in the SLO phase
    # AdaServe: whom the SLO phase serves first (selection.SLO_ORDERS): "smallest-need" as the artifact's
    # scheduler does, "largest-need" as the paper's text says; on the replayed rps 4.8 trace smallest-need
    # took the paper's configuration from 0.24 to 0.41 attainment (docs/benchmarks.md)
    slo_order: str = "smallest-need"
    # AdaServe: tokens the SLO phase aims above A(r) for a request with an SLO. A(r) is what the request must
    # emit on average; a tree chosen to meet it exactly falls short about half the time, and a request that
    # falls short needs more next time. On the replayed rps 4.8 trace a margin of 2 took ours from 0.60 to
    # 0.69 attainment (0.74 -> 0.76 at 4.2 req/s, a tie at 3.0; docs/benchmarks.md). 0: the paper's A(r).
    slo_margin: float = 2.0
    # AdaServe: the least value a node needs to be taken in the SLO phase. "price": what one more verified
    # token costs the batch in expected tokens (iteration_budget.token_price), so a request whose target is
    # beyond its tree does not pour its whole tree, worthless siblings included, into verification; what the
    # floor keeps out leaves the iteration. On the replayed Figure 11 at a 0.8x coding SLO that took ours from
    # 0.51 to 0.65 attainment (chain:4 0.55), at a cost of 0.005 at Figure 8's 4.72 req/s (docs/benchmarks.md).
    # "none": Algorithm 2's SLO phase, every node until A(r) is met.
    slo_floor: str = "price"
    smartspec_max_k: int = 8  # SmartSpec: the longest chain it may choose
    # the adaptive policies' shape rules price an iteration's host time (cost/host_cost.py: learnt from the
    # engine's own iterations, wall minus forwards) beside its forwards. Off by default: on the demo pair on an
    # AVX2 CPU it tied with the forwards alone, leaning behind (-0.013 and -0.022 attainment over 12 paired seeds
    # at 1.5 and 3.5 req/s; docs/benchmarks.md); where host time is as long as the forwards it is untested
    host_cost: bool = False
    adaptive: AdaptiveConfig = field(default_factory=AdaptiveConfig)

    # ---- how much an iteration takes on (engine.py) ----
    prefill_chunk: int = 256  # prompt tokens per step across requests (chunked prefill)
    # "fixed": prefill_chunk every iteration; "slo": the largest of prefill_chunk, /2, ... down to
    # prefill_min_chunk with which the decoding requests that can meet their TPOT SLO still do
    # (prefill_chunk.py); a scheduler setting, the same for every policy; "fixed" is the behaviour before it
    prefill_rule: str = "fixed"
    prefill_min_chunk: int = 32
    # the TTFT target (ms from arrival) the "slo" rule keeps a request being prefilled on when the request names
    # none (Request.ttft_slo_ms); None: such a request's first token is not waited for
    prefill_ttft_ms: float | None = None
    # "mixed": prefill chunks ride in the decoding iterations' forward (chunked prefill); "separate": an
    # iteration with requests to prefill prefills whole prompts (first come first served, while their sum is
    # at most prefill_chunk; the first always, however long) and decodes nothing, as vLLM v0 without
    # chunked prefill; prefill_rule must then be "fixed"
    prefill_mode: str = "mixed"
    max_batch: int = 64  # requests admitted at once

    # ---- how a forward runs (runner.py, kv_cache.py, attention/) ----
    attention: str = "auto"  # one of ATTENTION_BACKENDS
    kv: KVCacheConfig = field(default_factory=KVCacheConfig)
    # forwards of at most 32 new tokens per request on padded, persistent buffers: a CUDA graph per shape
    # bucket on a GPU, the same function eagerly on a CPU (model/static.py)
    static_shapes: bool = False
    # prefix caching (kv_cache.py, prefix_cache.py): full pages of committed KV are kept, keyed by their tokens
    # and everything before them, and a new request reuses its prompt's longest cached prefix instead of
    # prefilling it; output is unchanged (docs/architecture.md §3)
    prefix_caching: bool = True

    # ---- predicting an iteration's duration (timing.py) ----
    target_cost: CostModel | None = None  # profiled T_fwd of the target; learnt online when None
    draft_cost: CostModel | None = None
    drafts: MultiDraftConfig = field(default_factory=MultiDraftConfig)
    initial_forward_s: float = 0.02  # flat guess for an unprofiled forward, until measurements arrive

    history_len: int = 1024  # recent StepMetrics kept; totals are kept for the whole run
    profiler: ProfilerConfig = field(default_factory=ProfilerConfig)

    def __post_init__(self) -> None:
        at_least("EngineConfig", "budget", self.budget, 1)
        if self.node_value not in ("learned", "draft"):
            raise ValueError(f"EngineConfig.node_value must be 'learned' or 'draft', got {self.node_value!r}")
        if self.budget_rule not in BUDGET_RULES:
            raise ValueError(f"EngineConfig.budget_rule must be one of {', '.join(BUDGET_RULES)}, "
                             f"got {self.budget_rule!r}")
        at_least("EngineConfig", "n_max", self.n_max, 1)
        if not (isinstance(self.slo_margin, int | float) and math.isfinite(self.slo_margin) and self.slo_margin >= 0):
            raise ValueError(f"EngineConfig.slo_margin must be a finite number >= 0, got {self.slo_margin!r}")
        if self.slo_floor not in SLO_FLOORS:
            raise ValueError(f"EngineConfig.slo_floor must be one of {', '.join(SLO_FLOORS)}, got {self.slo_floor!r}")
        if self.slo_order not in SLO_ORDERS:
            raise ValueError(f"EngineConfig.slo_order must be one of {', '.join(SLO_ORDERS)}, got {self.slo_order!r}")
        at_least("EngineConfig", "smartspec_max_k", self.smartspec_max_k, 1)
        at_least("EngineConfig", "prefill_chunk", self.prefill_chunk, 1)
        if self.prefill_rule not in PREFILL_RULES:
            raise ValueError(f"EngineConfig.prefill_rule must be one of {', '.join(PREFILL_RULES)}, "
                             f"got {self.prefill_rule!r}")
        at_least("EngineConfig", "prefill_min_chunk", self.prefill_min_chunk, 1)  # capped at prefill_chunk
        if self.prefill_ttft_ms is not None:
            positive("EngineConfig", "prefill_ttft_ms", self.prefill_ttft_ms)
        if self.prefill_mode not in PREFILL_MODES:
            raise ValueError(f"EngineConfig.prefill_mode must be one of {', '.join(PREFILL_MODES)}, "
                             f"got {self.prefill_mode!r}")
        if self.prefill_mode == "separate" and self.prefill_rule != "fixed":
            raise ValueError("EngineConfig.prefill_mode 'separate' prefills whole prompts: prefill_rule must be "
                             f"'fixed', got {self.prefill_rule!r}")
        at_least("EngineConfig", "max_batch", self.max_batch, 1)
        at_least("EngineConfig", "history_len", self.history_len, 1)
        positive("EngineConfig", "initial_forward_s", self.initial_forward_s)
        if self.attention not in ATTENTION_BACKENDS:
            raise ValueError(f"EngineConfig.attention must be one of {', '.join(ATTENTION_BACKENDS)}, "
                             f"got {self.attention!r}")
        for name in ("target_cost", "draft_cost"):
            v = getattr(self, name)
            if v is not None and not isinstance(v, CostModel):
                raise ValueError(f"EngineConfig.{name} must be a CostModel or None, got {type(v).__name__}")
        # The policy name is checked where the policy is built from this config (policies.make_policy, called
        # by Engine and, before any model loads, by build_engine): policies import this module, not back.
