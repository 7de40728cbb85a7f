"""The bench's named systems: each a policy plus the scheduler settings its system ran with (issue 29).

The paper's baselines keep their own admission and prefill rule, and the paper's AdaServe its own
configuration, so every line of a plot is the system its name says. A preset is a bench-only object: the
engine's own defaults (``EngineConfig``, what ``adaserve worker --policy adaserve`` serves) are untouched.

    bench name        engine policy  running  prefill                               speculation
    vllm              incremental    512      whole prompts, prefill-only iterations
    sarathi           incremental    2048     chunks of 2048 beside the decodes
    vllm-spec:K       chain:K        512      as vllm                               K draft tokens, K >= 1
    adaserve          adaserve       64       chunks of 1024 (fixed)                d 4-8, w 3, Eq. 8 depth,
    (= adaserve-paper)                                                              fixed B, draft values,
                                                                                    SLO phase smallest need first,
                                                                                    no margin, no value floor
    adaserve+...      the paper's adaserve with one of our refinements (ADASERVE_REFINEMENTS)
    adaserve+ours     adaserve       the bench's own settings (--max-batch, --prefill-rule) and the
                                     engine's defaults: what the bench's ``adaserve`` was before issue 29

Where each setting comes from in the artifact: docs/benchmarks.md, issue 29's section. Any other name is an
engine policy (policies.make_policy) run with the bench's own settings, as before. A ``@SELECTOR`` suffix
(several drafts) carries over: ``vllm-spec:4@ucb`` is ``chain:4@ucb`` under vLLM's admission.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from adaserve.engine.config import EngineConfig
from adaserve.engine.speculation.adaptive import CHAIN_DEPTH
from adaserve.engine.speculation.policies import make_policy, split_policy

# vLLM v0 without chunked prefill batches prompts up to max_num_batched_tokens = max(max_model_len, 2048)
# tokens per prefill iteration: 131072 for Llama-3.1-70B-Instruct's context, i.e. no limit in practice
VLLM_PREFILL_TOKENS = 131072
VLLM_SPEC = "vllm-spec"


@dataclass(frozen=True)
class TreeBounds:
    """AdaServe's tree: depth between ``d_min`` and ``d_max``, at most ``w_max`` wide, depth by ``depth_rule``."""

    d_min: int
    d_max: int
    w_max: int
    depth_rule: str


@dataclass(frozen=True)
class Preset:
    """A named system: its engine policy and the EngineConfig fields it sets (None: the bench's own)."""

    name: str
    policy: str
    max_batch: int | None = None
    prefill_chunk: int | None = None
    prefill_mode: str | None = None
    prefill_rule: str | None = None
    budget_rule: str | None = None
    node_value: str | None = None
    slo_order: str | None = None
    slo_margin: float | None = None
    slo_floor: str | None = None
    host_cost: bool | None = None
    tree: TreeBounds | None = None
    depth_rule: str | None = None  # the tree's depth rule alone (adaptive.DEPTH_RULES), on the bench's bounds
    chains: bool | None = None  # every tree a chain: w_max 1 and, with a goodput depth rule, chains up to CHAIN_DEPTH

    def engine_config(self, base: EngineConfig) -> EngineConfig:
        """``base`` (the bench's settings for this variant) with this preset's fields, policy included."""
        names = ("max_batch", "prefill_chunk", "prefill_mode", "prefill_rule", "budget_rule", "node_value",
                 "slo_order", "slo_margin", "slo_floor", "host_cost")
        fields = {k: v for k in names if (v := getattr(self, k)) is not None}
        adaptive = base.adaptive if self.tree is None else replace(
            base.adaptive, d_min=self.tree.d_min, d_max=self.tree.d_max, w_max=self.tree.w_max,
            depth_rule=self.tree.depth_rule)
        if self.depth_rule is not None:
            adaptive = replace(adaptive, depth_rule=self.depth_rule)
        if self.chains:  # as adaptive.bounds_for_device bounds a device whose verifier charges per token
            adaptive = replace(adaptive, w_max=1, d_max=CHAIN_DEPTH if adaptive.by_goodput else adaptive.d_max)
        return replace(base, policy=self.policy, adaptive=adaptive, **fields)

    def describe(self) -> dict:
        """The settings this preset fixes, for the report (the others are the bench's)."""
        out = {k: v for k, v in vars(self).items() if v is not None and k != "tree"}
        if self.tree is not None:
            out["tree"] = vars(self.tree)
        return out


# exps/fig8,9/run_llama_rps.sh, ADASERVE: MAX_REQUESTS_PER_BATCH=64, CHUNK_SIZE=1024, MIN_TREE_DEPTH=4,
# MAX_TREE_DEPTH=8, MAX_TREE_WIDTH=3; the paper's section 5: a fixed profiled B, Eq. 8, draft path probability;
# the SLO phase's order as the artifact's scheduler sorts (selection.SLO_ORDERS)
PAPER_TREE = TreeBounds(d_min=4, d_max=8, w_max=3, depth_rule="eq8")
ADASERVE_PAPER = Preset("adaserve", "adaserve", max_batch=64, prefill_chunk=1024, prefill_mode="mixed",
                        prefill_rule="fixed", budget_rule="knee", node_value="draft", slo_order="smallest-need",
                        slo_margin=0.0, slo_floor="none", tree=PAPER_TREE)
# our refinements, one at a time on the paper's configuration
ADASERVE_REFINEMENTS = {
    "adaserve+goodput-budget": {"budget_rule": "goodput"},
    "adaserve+slo-prefill": {"prefill_rule": "slo"},
    "adaserve+learned-values": {"node_value": "learned"},
    "adaserve+goodput-depth": {"tree": replace(PAPER_TREE, depth_rule="goodput")},
    "adaserve+slo-margin": {"slo_margin": 2.0},
    "adaserve+slo-floor": {"slo_floor": "price"},
    # not a refinement: Algorithm 2's order as the paper's text gives it (largest A(r) first)
    "adaserve+text-order": {"slo_order": "largest-need"},
}
OURS = "adaserve+ours"
# ours with the tree's shape by goodput alone (adaptive.goodput_shape), as before the SLO-first shape (slo_shape)
OURS_GOODPUT_SHAPE = "adaserve+ours+goodput-shape"
# ours with the shape rules pricing the engine's host time beside the forwards (host_cost.py; EngineConfig.host_cost)
OURS_HOST_COST = "adaserve+ours+host-cost"
# ours with every tree a chain (w_max 1, so chains up to adaptive.CHAIN_DEPTH), whatever width the device's bounds
# allow: on a CPU whose verifier looks flat in the profile the bounds give beams, which may still not pay
OURS_CHAINS = "adaserve+ours+chains"

PRESETS: dict[str, Preset] = {
    # exps/test.sh, ENABLE_VLLM_SERVER_BENCHMARK: --enable-chunked-prefill False, MAX_REQUESTS_PER_BATCH=512
    "vllm": Preset("vllm", "incremental", max_batch=512, prefill_chunk=VLLM_PREFILL_TOKENS,
                   prefill_mode="separate", prefill_rule="fixed"),
    # exps/test.sh, ENABLE_VLLM_SARATHI_SERVE: --enable-chunked-prefill True, MAX_REQUESTS_PER_BATCH=2048,
    # MAX_NUM_BATCHED_TOKENS=2048
    "sarathi": Preset("sarathi", "incremental", max_batch=2048, prefill_chunk=2048, prefill_mode="mixed",
                      prefill_rule="fixed"),
    "adaserve": ADASERVE_PAPER,
    "adaserve-paper": replace(ADASERVE_PAPER, name="adaserve-paper"),
    **{name: replace(ADASERVE_PAPER, name=name, **kw) for name, kw in ADASERVE_REFINEMENTS.items()},
    OURS: Preset(OURS, "adaserve"),
    OURS_GOODPUT_SHAPE: Preset(OURS_GOODPUT_SHAPE, "adaserve", depth_rule="goodput"),
    OURS_HOST_COST: Preset(OURS_HOST_COST, "adaserve", host_cost=True),
    OURS_CHAINS: Preset(OURS_CHAINS, "adaserve", chains=True),
}
NAMES = (*PRESETS, f"{VLLM_SPEC}:K")


def vllm_spec(k: int) -> Preset:
    """exps/test.sh, ENABLE_VLLM_SPEC_INFER: vLLM's admission (as ``vllm``) with K speculative tokens
    (NUM_SPEC_TOKENS; exps/fig8,9/run_llama_rps.sh runs 4, 6, 8)."""
    return replace(PRESETS["vllm"], name=f"{VLLM_SPEC}:{k}", policy=f"chain:{k}")


def resolve(name: str) -> Preset | None:
    """The preset a bench name names, with its ``@SELECTOR`` carried to its policy; None for a plain engine
    policy (checked here too). Raises ValueError, one line, for a bad name."""
    base, selector = split_policy(name)
    if base.startswith(VLLM_SPEC + ":"):
        arg = base.removeprefix(VLLM_SPEC + ":")
        if not arg.isdigit() or int(arg) < 1:
            raise ValueError(f"bad policy {name!r}: {VLLM_SPEC}:K takes a number of draft tokens K >= 1, got {arg!r}")
        preset: Preset | None = vllm_spec(int(arg))
    else:
        preset = PRESETS.get(base)
    if preset is not None and selector is not None:
        preset = replace(preset, policy=f"{preset.policy}@{selector}")
    if preset is not None:
        make_policy(preset.policy)  # raises ValueError naming a bad selector
        return preset
    try:
        make_policy(name)
    except ValueError as e:
        raise ValueError(f"{e}; or a bench system: {', '.join(NAMES)}") from None
    return None
