"""The side-by-side benchmark: one arrival schedule, every policy, the same engine and hardware, one run.

    for each point of the sweep (a rate, a share of urgent requests, an SLO scale):
        workload = build_workload(point), or the --trace-json file's requests (emission_trace.py)
                                                               (same prompts, SLOs, arrival times),
                   or conversations (multi_turn.py): each later turn arrives a think time after the answer
                   before it, resending the whole conversation
        for each policy:   run it on a fresh Engine over the shared model runners,
                           on the wall clock or the simulated one (sim_clock.py, a device profile)
                           summarize(requests) -> attainment, goodput, TPOT, TTFT, acceptance ...
"""

from __future__ import annotations

import heapq
import logging
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from adaserve.bench.budget_use import BudgetUse
from adaserve.bench.draft_report import draft_regret, draft_use, size_of
from adaserve.bench.emission_trace import ARTIFACT_BASELINE_TPOT_MS, TraceWorkload, read_emission_trace
from adaserve.bench.hf_peer import HFPeer
from adaserve.bench.metrics import RequestResult, adaserve_ratios, summarize
from adaserve.bench.multi_turn import ChatDriver, ConversationWorkload, by_turn
from adaserve.bench.presets import Preset, resolve
from adaserve.bench.selection_gap import SelectionGap, budgeted
from adaserve.bench.sim.clock import FollowUp, SimClock, SimTotals, run_simulated
from adaserve.bench.sim.device_model import (
    HOST_MEASURED,
    MEASURED,
    DeviceProfile,
    ForwardCost,
    load_profile_file,
    profile_from_measured,
    scaled_draft,
)
from adaserve.bench.sim.profile import costs_of, profile_cost, simulated_profile
from adaserve.bench.workload import (
    DEFAULT_CLASSES,
    DEFAULT_MIX,
    PAPER_CLASSES,
    MultiTurnConfig,
    WorkloadConfig,
    WorkloadRequest,
    build_workload,
)
from adaserve.engine.build import adaptive_for, resolve_device
from adaserve.engine.config import PREFILL_RULES, EngineConfig, MultiDraftConfig
from adaserve.engine.cost.cost_model import CostModel
from adaserve.engine.cost.profiler import Profile, ProfilerConfig, profile_models
from adaserve.engine.engine import Engine, TokenEvent
from adaserve.engine.loading.chat import has_chat_template, instruction_ids
from adaserve.engine.loading.loader import load_model, load_tokenizer
from adaserve.engine.model.kv_cache import KVCacheConfig
from adaserve.engine.model.runner import ModelRunner
from adaserve.engine.ranks import start_target
from adaserve.engine.request import Request
from adaserve.engine.speculation.adaptive import AdaptiveConfig
from adaserve.engine.speculation.policies import SelectionRecord, make_policy, split_policy
from adaserve.engine.speculation.sampling import SamplingParams

log = logging.getLogger(__name__)

HF_PEER = "hf"  # not an engine policy: Hugging Face transformers serving the same arrivals
CLOCKS = ("wall", "simulated")
SWEEPS = ("rate", "urgent-share", "slo-scale")
# the generated workload's SLOs: every class relative to the baseline, or the paper's Table 2 (50 and 150 ms absolute)
SLO_CLASSES = {"relative": DEFAULT_CLASSES, "paper": PAPER_CLASSES}
URGENT = "coding"  # the class with the tightest SLO: the "urgent" requests of the paper's Figure 10
PREFIX_CACHE_LABEL = " (prefix cache)"  # --compare-prefix-caching: the cached copy of each variant


@dataclass(frozen=True)
class BenchConfig:
    target: Path
    draft: Path
    extra_drafts: tuple[Path, ...] = ()  # more drafts: policies choose per request (POLICY@SELECTOR, spin)
    model: str = ""  # the name the pair was asked for (catalog), for the report
    policies: tuple[str, ...] = ("adaserve", "incremental", "chain:4", "smartspec", "specinfer")
    rates: tuple[float, ...] = (1.0,)
    duration_s: float = 30.0
    trace: Path | None = None
    trace_json: Path | None = None  # the artifact's workload file: arrivals, prompts, SLOs, output lengths
    mix: dict[str, float] | None = None
    slo_classes: str = "relative"  # a key of SLO_CLASSES
    output_tokens: int | None = None  # every output exactly this long, EOS ignored (the paper's 256); None: drawn
    slo_scale: float = 1.0
    seed: int = 0
    device: str = "cpu"
    budget: int | None = None  # None: the profiled budget
    budgets: tuple[int | str, ...] = ()  # a sweep of adaserve budgets ("auto" = profiled)
    max_tokens_cap: int | None = 128  # None (trace_json only): the trace's output lengths as given
    max_prompt_tokens: int | None = 512  # None: as many as the models' context leaves (always at most that)
    kv_memory_mb: int = 512
    max_batch: int = EngineConfig.max_batch  # requests running at once; the rest wait in the engine's queue
    prefill_rule: str = EngineConfig.prefill_rule  # "fixed" or "slo" (prefill_chunk.py), for every policy
    # the bench draws prompts with replacement: with caching on, a repeated prompt skips its prefill in every
    # system, so it is off unless asked for (the committed figures were made without it)
    prefix_caching: bool = False
    compare_prefix_caching: bool = False  # every variant twice, without and with prefix caching, same arrivals
    # multi-turn chat (multi_turn.py): this many conversations started at each rate (conversations/s) in place
    # of the generated workload, each of ``turns`` turns, the next sent ``think_s`` after an answer
    conversations: int | None = None
    turns: int = 2
    think_s: float = MultiTurnConfig.think_s
    system_chars: int = MultiTurnConfig.system_chars
    baseline_tpot_ms: float | None = None  # None: measured, or with trace_json the artifact's 30 ms
    clock: str = "wall"  # "simulated": time from ``device_profile`` (sim_clock.py)
    device_profile: str = MEASURED  # simulated: "measured" (this machine's profile), a shipped name or a file
    # simulated: scheduler time per iteration, ms, or "measured" (host time); None: the analytic profile's
    # figure, or host time with the measured profile
    sched_ms: float | str | None = None
    sweep: str = "rate"  # rate: over ``rates``; urgent-share / slo-scale: over ``values`` at ``rates[0]``
    values: tuple[float, ...] = ()
    tensor_parallel_size: int = 1  # ranks the target is sharded over (engine/ranks.py); the drafts stay whole

    @property
    def answer_tokens(self) -> int:
        """Conversations: every answer's length (the fixed output length, else the cap)."""
        return self.output_tokens or self.max_tokens_cap or MultiTurnConfig.max_tokens

    def __post_init__(self) -> None:
        if not self.policies and not self.budgets:
            raise ValueError("give at least one policy or budget")
        if not self.rates or min(self.rates) <= 0:
            raise ValueError("rates must be positive")
        if self.duration_s <= 0:
            raise ValueError("duration must be positive")
        if any(v is not None and v < 1 for v in (self.max_prompt_tokens, self.max_tokens_cap)) or self.max_batch < 1:
            raise ValueError("max_prompt_tokens, max_tokens_cap and max_batch must be >= 1")
        if self.max_tokens_cap is None and self.trace_json is None:
            raise ValueError("max_tokens_cap may only be left open with trace_json (its output lengths)")
        if self.slo_classes not in SLO_CLASSES:
            raise ValueError(f"slo_classes must be one of {', '.join(SLO_CLASSES)}, got {self.slo_classes!r}")
        if self.output_tokens is not None and self.output_tokens < 1:
            raise ValueError("output_tokens must be >= 1")
        if self.trace_json is not None:
            if self.trace is not None or self.mix is not None:
                raise ValueError("a trace-json file sets the arrivals and classes: give no trace or mix with it")
            if self.output_tokens is not None or self.slo_classes != "relative":
                raise ValueError("a trace-json file sets the output lengths and SLOs: give no output_tokens or "
                                 "slo_classes with it")
            if self.sweep == "urgent-share":
                raise ValueError("a trace-json file fixes the classes' shares: it cannot sweep urgent-share")
            if HF_PEER in self.policies:
                raise ValueError("the hf peer stops at end-of-sequence: a trace-json file's outputs are fixed lengths")
        if self.prefill_rule not in PREFILL_RULES:
            raise ValueError(f"prefill_rule must be one of {', '.join(PREFILL_RULES)}, got {self.prefill_rule!r}")
        if self.clock not in CLOCKS:
            raise ValueError(f"clock must be one of {', '.join(CLOCKS)}, got {self.clock!r}")
        if self.sweep not in SWEEPS:
            raise ValueError(f"sweep must be one of {', '.join(SWEEPS)}, got {self.sweep!r}")
        if self.sweep != "rate" and (not self.values or len(self.rates) != 1):
            raise ValueError(f"--sweep {self.sweep} needs --values and exactly one rate")
        if self.sweep == "urgent-share" and not all(0 <= v <= 1 for v in self.values):
            raise ValueError("urgent shares must be in [0, 1]")
        if self.sweep == "slo-scale" and not all(v > 0 for v in self.values):
            raise ValueError("SLO scales must be positive")
        if isinstance(self.sched_ms, str) and self.sched_ms != HOST_MEASURED:
            raise ValueError(f"sched_ms must be milliseconds or {HOST_MEASURED!r}, got {self.sched_ms!r}")
        if isinstance(self.sched_ms, float | int) and not self.sched_ms >= 0:
            raise ValueError("sched_ms must be >= 0")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor parallel size must be at least 1, got {self.tensor_parallel_size}")
        if self.prefix_caching and self.compare_prefix_caching:
            raise ValueError("compare_prefix_caching runs every policy with and without caching: "
                             "do not also turn it on for all")
        if self.conversations is not None:
            if self.trace_json is not None:
                raise ValueError("conversations and a trace-json file are two workloads: give one")
            if HF_PEER in self.policies:
                raise ValueError("the hf peer serves a fixed arrival list: it cannot run conversations")
            # raises ValueError naming the bad setting
            MultiTurnConfig(conversations=self.conversations, turns=self.turns, rate=min(self.rates),
                            think_s=self.think_s, system_chars=self.system_chars, max_tokens=self.answer_tokens)
        if self.clock == "simulated" and HF_PEER in self.policies:
            raise ValueError("the hf peer runs on the wall clock only: drop it from a simulated bench")
        for p in self.policies:
            if p != HF_PEER:
                resolve(p)  # raises ValueError naming the bad policy or bench system (presets.py)


@dataclass
class Variant:
    label: str
    policy: str  # the engine's policy (a preset's, for a named system)
    budget: int
    budget_rule: str = "goodput"
    preset: Preset | None = None  # a named system's settings over the bench's (presets.py)
    prefix_caching: bool | None = None  # None: the bench's setting


def named_variant(name: str, budget: int) -> Variant:
    """The variant a ``--policies`` name runs: a named system (presets.py) or an engine policy."""
    preset = None if name == HF_PEER else resolve(name)
    return Variant(name, name if preset is None else preset.policy, budget, preset=preset)


@dataclass
class Shared:
    target: ModelRunner
    draft: ModelRunner  # the first draft
    tokenizer: Any
    profile: Profile | None
    budget: int
    variants: list[Variant] = field(default_factory=list)
    hf: HFPeer | None = None
    device: DeviceProfile | None = None  # set for a simulated bench
    sched_s: float | None = None  # simulated: fixed scheduler time per iteration (None: host-measured)
    max_batch: int = EngineConfig.max_batch
    prefill_rule: str = EngineConfig.prefill_rule
    prefix_caching: bool = False
    drafts: list[ModelRunner] = field(default_factory=list)  # every draft, the first included
    draft_names: list[str] = field(default_factory=list)
    draft_prices: list[ForwardCost] = field(default_factory=list)  # simulated: each draft's price
    draft_costs: list[CostModel | None] = field(default_factory=list)  # each draft's profiled cost model

    @property
    def simulated(self) -> bool:
        return self.device is not None

    def engine_drafts(self, policy: str) -> list[int]:
        """Which drafts an engine for ``policy`` gets: every draft, or one (``@dN``, or one draft only)."""
        selector = split_policy(policy)[1]
        if selector is not None and selector.startswith("d") and selector[1:].isdigit():
            if int(selector[1:]) >= len(self.drafts):
                raise ValueError(f"policy {policy!r}: there are only {len(self.drafts)} drafts")
            return [int(selector[1:])]
        return list(range(len(self.drafts)))


def load_shared(cfg: BenchConfig, *, progress: bool) -> Shared:
    dev = resolve_device(cfg.device)
    rc = EngineConfig(kv=KVCacheConfig(memory_bytes=cfg.kv_memory_mb * 2**20))
    if cfg.tensor_parallel_size > 1:  # this process is rank 0; every variant's engine reuses the sharded target
        target = start_target(cfg.target, cfg.tensor_parallel_size, device=dev, settings=rc, progress=progress)
    else:
        target = ModelRunner(load_model(cfg.target, device=dev, progress=progress), rc)
    draft = ModelRunner(load_model(cfg.draft, device=dev, progress=progress), rc)
    extra = [ModelRunner(load_model(p, device=dev, progress=progress), rc) for p in cfg.extra_drafts]
    device: DeviceProfile | None = None
    sched_s = None if cfg.sched_ms is None or cfg.sched_ms == HOST_MEASURED else float(cfg.sched_ms) / 1e3
    if cfg.clock == "simulated" and cfg.device_profile != MEASURED:
        # the engine is configured as a worker on that device would be: its profile, priced by the model
        device = load_profile_file(cfg.device_profile)
        data = simulated_profile(device)
        b, tc, dc = costs_of(data)
        prof: Profile | None = Profile(device=f"simulated {device.name}", budget=b, target_cost=tc, draft_cost=dc,
                                       data=data, cached=False)
        sched_s = device.sched_s if cfg.sched_ms is None else sched_s
    elif cfg.budget is None or "auto" in cfg.budgets or cfg.clock == "simulated":
        prof = profile_models(target, draft, target_path=cfg.target, draft_path=cfg.draft, progress=progress)
        if cfg.clock == "simulated":
            device = profile_from_measured(prof.data, sched_s=sched_s or 0.0)
    else:
        prof = None
    budget = cfg.budget if cfg.budget is not None else (prof.budget if prof else EngineConfig().budget)
    shared = Shared(target, draft, load_tokenizer(cfg.target), prof, budget, device=device, sched_s=sched_s,
                    max_batch=cfg.max_batch, prefill_rule=cfg.prefill_rule, prefix_caching=cfg.prefix_caching)
    _add_drafts(shared, [draft, *extra], [cfg.draft, *cfg.extra_drafts])
    shared.variants = [named_variant(p, budget) for p in cfg.policies]
    if HF_PEER in cfg.policies:
        eos = shared.target.model.cfg.eos_token_ids
        pad = shared.tokenizer.pad_token_id if shared.tokenizer.pad_token_id is not None else (eos[0] if eos else 0)
        shared.hf = HFPeer(cfg.target, cfg.draft, eos_token_id=eos[0] if eos else None, pad_token_id=pad)
    for b in cfg.budgets:
        value = prof.budget if b == "auto" and prof else int(b)
        # a fixed budget, as the knee rule alone would give it (the default rule only uses B as a floor)
        shared.variants.append(Variant(f"adaserve@B={b}" + (f"({value})" if b == "auto" else ""), "adaserve", value,
                                       budget_rule="knee"))
    if cfg.compare_prefix_caching:
        shared.variants = [w for v in shared.variants for w in cache_pair(v)]
    return shared


def cache_pair(v: Variant) -> list[Variant]:
    """``v`` without prefix caching, then with it (labelled ``PREFIX_CACHE_LABEL``); the hf peer has no cache."""
    if v.policy == HF_PEER:
        return [v]
    return [replace(v, prefix_caching=False), replace(v, label=v.label + PREFIX_CACHE_LABEL, prefix_caching=True)]


def draft_label(path: Path) -> str:
    """A draft's name for reports: its directory's, less the cache key a materialised draft carries."""
    head, _, key = path.name.rpartition("-")
    return head if head and len(key) == 16 and all(c in "0123456789abcdef" for c in key) else path.name


def _add_drafts(shared: Shared, drafts: list[ModelRunner], paths: list[Path]) -> None:
    """Every draft with its name, its price on a simulated device and its profiled cost model.

    A simulated device prices one draft; another is priced as that draft scaled by the ratio of the real
    drafts' sizes (device_model.scaled_draft; the profile README states the assumption)."""
    shared.drafts, shared.draft_names = drafts, [draft_label(p) for p in paths]
    first = shared.profile.draft_cost if shared.profile else None
    shared.draft_costs = [first] + [None] * (len(drafts) - 1)
    if shared.device is None:
        return
    p0, kv0 = size_of(drafts[0])
    shared.draft_prices = [shared.device.draft]
    for d in drafts[1:]:
        p, kv = size_of(d)
        price = scaled_draft(shared.device.draft, params_ratio=p / p0, kv_ratio=kv / kv0)
        shared.draft_prices.append(price)
        shared.draft_costs.append(CostModel.from_dict(profile_cost(price, ProfilerConfig())["cost_model"]))


def tree_bounds(shared: Shared) -> AdaptiveConfig:
    """The adaptive tree bounds a worker on this (possibly simulated) device would use."""
    return adaptive_for(AdaptiveConfig(), shared.profile.data) if shared.profile else AdaptiveConfig()


def make_engine(shared: Shared, variant: Variant) -> Engine:
    prof = shared.profile
    use = shared.engine_drafts(variant.policy) if shared.drafts else [0]
    costs = shared.draft_costs or [prof.draft_cost if prof else None]
    extra = tuple(c for c in (costs[i] for i in use[1:]) if c is not None)
    cfg = EngineConfig(policy=variant.policy, budget=variant.budget, budget_rule=variant.budget_rule,
                       adaptive=tree_bounds(shared), target_cost=prof.target_cost if prof else None,
                       draft_cost=costs[use[0]], max_batch=shared.max_batch, prefill_rule=shared.prefill_rule,
                       prefix_caching=(shared.prefix_caching if variant.prefix_caching is None
                                       else variant.prefix_caching),
                       drafts=MultiDraftConfig(extra_costs=extra if len(extra) == len(use) - 1 else ()))
    if variant.preset is not None:  # a named system: its own admission, prefill and tree settings
        cfg = variant.preset.engine_config(cfg)
    drafts = [(shared.drafts or [shared.draft])[i] for i in use]
    speculates = make_policy(cfg.policy, cfg).max_shape is not None
    return Engine(shared.target, drafts if speculates else None, cfg,
                  clock=SimClock() if shared.simulated else time.perf_counter)


def serve(shared: Shared, eng: Engine, arrivals: list[tuple[float, Request]],
          on_step: Callable[[list[TokenEvent]], None] | None = None,
          follow_up: FollowUp | None = None) -> SimTotals | None:
    """Run ``arrivals`` to completion on the engine's clock; the simulated time's breakdown, if simulated.
    ``follow_up``: the arrivals a finished request brings (a conversation's next turn; sim/clock.py)."""
    if shared.device is None:
        if follow_up is None:
            eng.run(arrivals, on_step=on_step)
        else:
            serve_wall(eng, arrivals, follow_up, on_step=on_step)
        return None
    assert isinstance(eng.clock, SimClock)
    prices = None
    if shared.draft_prices:  # each of the engine's drafts at its own price
        prices = [shared.draft_prices[next(i for i, d in enumerate(shared.drafts) if d is e)] for e in eng.drafts]
    return run_simulated(eng, arrivals, shared.device, eng.clock, sched_s=shared.sched_s, on_step=on_step,
                         draft_costs=prices, follow_up=follow_up)


def serve_wall(eng: Engine, arrivals: list[tuple[float, Request]], follow_up: FollowUp,
               on_step: Callable[[list[TokenEvent]], None] | None = None) -> None:
    """``Engine.run`` on the wall clock, with the arrivals each finished request brings joining the schedule."""
    pending = [(t, i, r) for i, (t, r) in enumerate(sorted(arrivals, key=lambda a: a[0]))]
    made = len(pending)
    start = eng.clock()
    while pending or eng.has_work:
        now = eng.clock() - start
        while pending and pending[0][0] <= now:
            eng.add_request(heapq.heappop(pending)[2])
        if not eng.has_work:
            time.sleep(max(0.0, min(pending[0][0] - now, 0.05)))
            continue
        events = eng.step()
        for e in events:
            if e.finished:
                for t, req in follow_up(e.request_id, eng.clock() - start):
                    heapq.heappush(pending, (t, made, req))
                    made += 1
        if on_step is not None:
            on_step(events)


def measure_baseline_tpot(shared: Shared, *, tokens: int = 48, runs: int = 5) -> float:
    """Unloaded per-token latency of the target alone (incremental decoding, one request), in ms.

    The minimum over runs after a warm-up: interference from anything else on the machine only ever
    adds time, and every SLO of the workload is a multiple of this number.
    """
    out = []
    if shared.simulated and shared.sched_s is not None:
        runs = 1  # the simulated clock gives the same figure every time
    for i in range(runs + 1):
        eng = make_engine(shared, Variant("baseline", "incremental", shared.budget))
        req = Request(f"baseline-{i}", shared.tokenizer.encode("def main():"),
                      SamplingParams(max_tokens=tokens, ignore_eos=True))
        serve(shared, eng, [(0.0, req)])
        if i > 0 and req.metrics.tpot_ms is not None:  # the first run warms up
            out.append(req.metrics.tpot_ms)
    return min(out)


def context_room(shared: Shared) -> int:
    """Tokens a prompt and its output may fill in every engine of the bench: the models' shortest context
    less the deepest tree any policy may write past them (``Engine.check_request``'s rule)."""
    knobs = EngineConfig(adaptive=tree_bounds(shared))
    engines = [v for v in shared.variants if v.policy != HF_PEER]  # a named system's own tree bounds count
    shapes = [make_policy(v.policy, v.preset.engine_config(knobs) if v.preset else knobs).max_shape for v in engines]
    depth = max((s.depth for s in shapes if s is not None), default=0)
    return min(r.model.cfg.max_position_embeddings for r in [shared.target, *shared.drafts]) - depth - 1


def prompt_limit(w: WorkloadRequest, room: int, max_prompt_tokens: int | None) -> int:
    """The most prompt tokens ``w`` may keep: ``min(max_prompt_tokens, room - max_tokens)``."""
    return limit_for(w.request_id, w.max_tokens, room, max_prompt_tokens)


def limit_for(what: str, max_tokens: int, room: int, max_prompt_tokens: int | None) -> int:
    """The most prompt tokens a request of ``max_tokens`` output may keep: ``min(max_prompt_tokens, room -
    max_tokens)``; ValueError naming ``what`` when that leaves none."""
    limit = room - max_tokens if max_prompt_tokens is None else min(max_prompt_tokens, room - max_tokens)
    if limit < 1:
        raise ValueError(f"{what}: {max_tokens} output tokens leave no room for a prompt in the models' "
                         f"context ({room} tokens past the deepest tree)")
    return limit


def prompt_ids(shared: Shared, w: WorkloadRequest, limit: int) -> tuple[list[int], bool]:
    """``w``'s prompt tokens, cut from the left to ``limit``, and whether it was cut. The tail keeps the chat
    template's opening of the assistant turn."""
    ids = instruction_ids(shared.tokenizer, w.prompt)
    return ids[-limit:], len(ids) > limit


def to_requests(workload: list[WorkloadRequest], shared: Shared, cfg: BenchConfig) -> list[tuple[float, Request]]:
    room = context_room(shared)
    out = []
    for w in workload:
        ids, _ = prompt_ids(shared, w, prompt_limit(w, room, cfg.max_prompt_tokens))
        req = Request(w.request_id, ids, SamplingParams(max_tokens=w.max_tokens, seed=cfg.seed,
                                                        ignore_eos=w.ignore_eos),
                      tpot_slo_ms=w.tpot_slo_ms)
        out.append((w.arrival_s, req))
    return out


def truncated_prompts(workload: list[WorkloadRequest], shared: Shared, cfg: BenchConfig) -> int:
    """How many of ``workload``'s prompts ``to_requests`` cuts."""
    room = context_room(shared)
    return sum(prompt_ids(shared, w, prompt_limit(w, room, cfg.max_prompt_tokens))[1] for w in workload)


def run_variant(shared: Shared, variant: Variant, workload: list[WorkloadRequest] | ConversationWorkload,
                cfg: BenchConfig, bar: tqdm, *, duration_s: float | None = None) -> tuple[dict, dict[str, list[int]]]:
    """One (variant, workload) run: its summary and every request's output tokens. Rates are per second of
    the run, at least ``duration_s`` (default ``cfg.duration_s``), the span the arrivals were spread over.
    Conversations: the first turns arrive at their start times, each later turn when the driver makes it."""
    driver: ChatDriver | None = None
    if isinstance(workload, ConversationWorkload):
        room = context_room(shared)
        driver = ChatDriver(workload, shared.tokenizer,
                            lambda n: limit_for("a conversation's turn", n, room, cfg.max_prompt_tokens),
                            seed=cfg.seed)
        arrivals = driver.first_turns()
        classes = driver.classes
    else:
        arrivals = to_requests(workload, shared, cfg)
        classes = {w.request_id: w.slo_class for w in workload}
    select_s = step_s = 0.0
    # Algorithm 2 (and kin) against Algorithm 1; in simulated runs on every 10th iteration (it is slow)
    tree_policy = split_policy(variant.policy)[0]
    gap = SelectionGap(stride=10 if shared.simulated else 1) if budgeted(tree_policy) else None
    use = BudgetUse(tree_policy.partition(":")[0], n_max=EngineConfig().n_max)
    sim: SimTotals | None = None
    eng: Engine | None = None
    t0 = time.perf_counter()
    if variant.policy == HF_PEER:
        assert shared.hf is not None
        shared.hf.run(arrivals, on_done=bar.update)
        wall = time.perf_counter() - t0
    else:
        eng = make_engine(shared, variant)
        # on the wall clock a listener's time is the requests' time: there the iterations' records are only kept,
        # and measured once the run is over (BudgetUse replays Algorithm 2's phases on every one of them: inside
        # the iterations that charged adaserve, and no other policy, ~0.1-0.3 ms each; issue 29's wall clock)
        kept: list[SelectionRecord] = []
        listeners = [use.observe, *([gap.observe] if gap is not None else [])]
        eng.selection_listeners.extend(listeners if shared.simulated else [kept.append])

        def on_step(events: list[TokenEvent]) -> None:
            bar.update(sum(1 for e in events if e.finished))

        start = eng.clock()
        sim = serve(shared, eng, arrivals, on_step=on_step, follow_up=driver.follow_up if driver else None)
        wall = eng.clock() - start  # simulated seconds when simulated
        for record in kept:
            for listener in listeners:
                listener(record)
        select_s, step_s = eng.totals.t_select_s, eng.totals.t_step_s
        if sim is not None:  # the scheduler's time is charged by the simulation, outside the engine's steps
            select_s, step_s = sim.sched_s, sim.busy_s
    served = list(driver.requests.values()) if driver else [r for _, r in arrivals]
    results = [
        RequestResult(r.request_id, classes[r.request_id], float(r.tpot_slo_ms or 0.0), len(r.output_ids),
                      r.metrics.tpot_ms, r.metrics.ttft_ms, tuple(r.metrics.accepted_per_step), r.finish_reason)
        for r in served
    ]
    span = cfg.duration_s if duration_s is None else duration_s
    # goodput over the makespan (the drain may end past the window) and over the arrival window (the paper's);
    # conversations have no arrival window (later turns arrive when answers end): the makespan only
    summary = summarize(results, wall_s=max(wall, span), select_s=select_s, step_s=step_s,
                        window_s=None if driver else span)
    if eng is not None:
        summary["prefix_cache"] = {**prefix_cache_use(served),
                                   "target_evictions": eng.target.cache.prefix_stats.evictions}
    if driver is not None:
        summary["prompts_truncated"] = driver.truncated  # each cut loses its conversation's cached prefix
        summary["turns"] = by_turn(driver, {r.request_id for r in results if r.met_slo})
    if gap is not None:
        summary["selection_vs_optimal"] = gap.summary()
    if variant.policy != HF_PEER:
        summary["budget_use"] = use.summary()
    if sim is not None:
        summary["simulated"] = {"target_s": sim.target_s, "draft_s": sim.draft_s, "sched_s": sim.sched_s,
                                "idle_s": sim.idle_s, "iterations": sim.iterations,
                                "mean_step_ms": 1e3 * sim.busy_s / max(1, sim.iterations)}
    if eng is not None and len(shared.drafts) > 1 and eng.drafts:
        names = [shared.draft_names[next(i for i, d in enumerate(shared.drafts) if d is e)] for e in eng.drafts]
        summary["drafts"] = draft_use(served, classes, names, eng.pool)
    summary["real_s"] = time.perf_counter() - t0  # wall clock, whatever the run's clock
    return summary, {r.request_id: r.output_ids for r in served}


def prefix_cache_use(requests: list[Request]) -> dict[str, float | int]:
    """Prompt tokens, those whose KV the prefix cache gave (not prefilled by the target), and their share."""
    prompt = sum(len(r.prompt_ids) for r in requests)
    cached = sum(r.metrics.cached_tokens for r in requests)
    return {"prompt_tokens": prompt, "cached_tokens": cached, "prefilled_tokens": prompt - cached,
            "hit_rate": cached / prompt if prompt else 0.0}


def same_outputs(ours: dict[str, list[int]], reference: dict[str, list[int]]) -> float:
    """Share of requests whose tokens equal the reference's (1.0 = lossless against it)."""
    return sum(ours[k] == reference[k] for k in reference) / len(reference) if reference else 1.0


@dataclass(frozen=True)
class SweepPoint:
    x: float  # the swept value: a rate, a share of urgent requests or an SLO scale
    # generated, a trace-json file's or conversations (each gives rate, mix, slo_scale, duration_s)
    workload: WorkloadConfig | TraceWorkload | ConversationWorkload

    def requests(self) -> list[WorkloadRequest] | ConversationWorkload:
        """The requests, or the conversations (their later turns are made as the run goes)."""
        w = self.workload
        if isinstance(w, ConversationWorkload):
            return w
        return w.build() if isinstance(w, TraceWorkload) else build_workload(w)


def urgent_mix(share: float, base: dict[str, float] | None = None) -> dict[str, float]:
    """The mix with ``share`` of URGENT requests, the other classes keeping their relative shares."""
    base = dict(base or DEFAULT_MIX)
    others = {k: v for k, v in base.items() if k != URGENT}
    rest = sum(others.values())
    mix = {URGENT: share, **{k: (1 - share) * v / rest for k, v in others.items()}}
    return {k: v for k, v in mix.items() if v > 0}


def sweep_points(cfg: BenchConfig, baseline_tpot_ms: float) -> list[SweepPoint]:
    if cfg.trace_json is not None:  # the file is the workload: one point at its rate, or one per SLO scale
        trace = read_emission_trace(cfg.trace_json)

        def tw(scale: float) -> TraceWorkload:
            return TraceWorkload(trace, baseline_tpot_ms, slo_scale=scale, max_tokens_cap=cfg.max_tokens_cap)

        if cfg.sweep == "slo-scale":
            return [SweepPoint(v, tw(v)) for v in cfg.values]
        return [SweepPoint(trace.rate_rps, tw(cfg.slo_scale))]

    def wc(rate: float, **kw: Any) -> WorkloadConfig:
        args: dict[str, Any] = {"mix": cfg.mix} if cfg.mix else {}
        args.update({"slo_scale": cfg.slo_scale, **kw})
        return WorkloadConfig(rate, cfg.duration_s, baseline_tpot_ms=baseline_tpot_ms, seed=cfg.seed,
                              max_tokens_cap=cfg.max_tokens_cap or WorkloadConfig.max_tokens_cap, trace=cfg.trace,
                              classes=SLO_CLASSES[cfg.slo_classes], fixed_output_tokens=cfg.output_tokens, **args)

    def chats(rate: float, **kw: Any) -> ConversationWorkload:
        assert cfg.conversations is not None
        mt = MultiTurnConfig(conversations=cfg.conversations, turns=cfg.turns, rate=rate, think_s=cfg.think_s,
                             max_tokens=cfg.answer_tokens,
                             system_chars=cfg.system_chars, trace=cfg.trace, seed=cfg.seed)
        # the mix and SLOs as the generated workload would have them (WorkloadConfig validates them)
        w = WorkloadConfig(rate, 1.0, baseline_tpot_ms=baseline_tpot_ms, mix=kw.get("mix") or cfg.mix or DEFAULT_MIX,
                           classes=SLO_CLASSES[cfg.slo_classes], slo_scale=kw.get("slo_scale", cfg.slo_scale))
        return ConversationWorkload(mt, baseline_tpot_ms, w.classes, dict(w.mix), slo_scale=w.slo_scale)

    make: Callable[..., WorkloadConfig | ConversationWorkload] = wc if cfg.conversations is None else chats
    if cfg.sweep == "rate":
        return [SweepPoint(r, make(r)) for r in cfg.rates]
    rate = cfg.rates[0]
    if cfg.sweep == "urgent-share":
        return [SweepPoint(v, make(rate, mix=urgent_mix(v, cfg.mix))) for v in cfg.values]
    return [SweepPoint(v, make(rate, slo_scale=v)) for v in cfg.values]


def run_bench(cfg: BenchConfig, *, progress: bool = True) -> dict:
    shared = load_shared(cfg, progress=progress)
    try:
        return _run_bench(cfg, shared, progress=progress)
    finally:
        shared.target.close()  # a tensor-parallel target stops its other ranks


def _run_bench(cfg: BenchConfig, shared: Shared, *, progress: bool) -> dict:
    # a trace's relative SLOs are multiples of the artifact's own baseline, not of this machine's
    baseline = cfg.baseline_tpot_ms or (ARTIFACT_BASELINE_TPOT_MS if cfg.trace_json else measure_baseline_tpot(shared))
    points = [(pt, pt.requests()) for pt in sweep_points(cfg, baseline)]
    # the target's own greedy output (incremental decoding) is the reference every policy must reproduce
    variants = sorted(shared.variants, key=lambda v: v.policy != "incremental")
    total = sum(w.turns if isinstance(w, ConversationWorkload) else len(w) for _, w in points) * len(variants)
    rows: list[dict] = []
    ratios: dict[str, Any] = {}
    regret: dict[str, Any] = {}
    with tqdm(total=total, desc="bench", unit="req", disable=not progress) as bar:
        for pt, wl in points:
            if not isinstance(wl, ConversationWorkload) and not wl:
                log.warning("rate %.3g over %.0fs gives no requests: skipped", pt.workload.rate, cfg.duration_s)
                continue
            # conversations: counted as their turns are made (each run's summary)
            cut = 0 if isinstance(wl, ConversationWorkload) else truncated_prompts(wl, shared, cfg)
            by_label = {}
            reference: dict[str, list[int]] | None = None
            for v in variants:
                bar.set_postfix_str(f"{v.label} @ {cfg.sweep}={pt.x:g}")
                summary, outputs = run_variant(shared, v, wl, cfg, bar, duration_s=pt.workload.duration_s)
                # greedy everywhere: every engine policy must reproduce the reference's tokens exactly
                if v.policy != HF_PEER:
                    reference = reference or outputs
                match = same_outputs(outputs, reference) if reference else None
                by_label[v.label] = summary
                rows.append({"policy": v.label, "sweep": cfg.sweep, "x": pt.x, "rate_rps": pt.workload.rate,
                             "slo_scale": pt.workload.slo_scale, "mix": dict(pt.workload.mix), "budget": v.budget,
                             # a named system's own settings (presets.py); None: the bench's, in "config"
                             "system": v.preset.describe() if v.preset else None,
                             "prefix_caching": cfg.prefix_caching if v.prefix_caching is None else v.prefix_caching,
                             "outputs_equal_reference": match, "prompts_truncated": cut, **summary})
            ratios[f"{pt.x:g}"] = adaserve_ratios(by_label)
            if len(shared.drafts) > 1:
                regret[f"{pt.x:g}"] = draft_regret(by_label)
    has_incremental = any(v.policy == "incremental" for v in variants)
    engine_rows = [r for r in rows if r["policy"] != HF_PEER]
    return {
        "device": shared.profile.device if shared.profile else cfg.device,
        "clock": cfg.clock,
        "budget": shared.budget,
        "baseline_tpot_ms": baseline,
        # every engine policy produced the target's own greedy tokens (incremental decoding is the target alone)
        "lossless": (all(r["outputs_equal_reference"] == 1.0 for r in engine_rows) if has_incremental else None),
        "config": {"policies": list(cfg.policies), "budgets": [str(b) for b in cfg.budgets],
                   "rates_rps": list(cfg.rates), "duration_s": cfg.duration_s, "slo_scale": cfg.slo_scale,
                   "sweep": cfg.sweep, "values": list(cfg.values),
                   "seed": cfg.seed, "trace": str(cfg.trace) if cfg.trace else None, "mix": cfg.mix,
                   "trace_json": str(cfg.trace_json) if cfg.trace_json else None,
                   "slo_classes": cfg.slo_classes, "output_tokens": cfg.output_tokens,
                   "model": cfg.model, "target": str(cfg.target), "draft": str(cfg.draft),
                   "drafts": [str(p) for p in (cfg.draft, *cfg.extra_drafts)],
                   "draft_names": shared.draft_names,
                   # every setting that shaped the numbers besides the above
                   "dtype": str(shared.target.dtype).removeprefix("torch."), "torch_threads": torch.get_num_threads(),
                   "adaptive": asdict(tree_bounds(shared)),
                   "budget_rule": EngineConfig().budget_rule,
                   "max_tokens_cap": cfg.max_tokens_cap, "max_prompt_tokens": cfg.max_prompt_tokens,
                   "kv_memory_mb": cfg.kv_memory_mb, "max_batch": cfg.max_batch,
                   "tensor_parallel_size": shared.target.tensor_parallel_size,  # the runner's own: ranks started
                   "prefill_chunk": EngineConfig().prefill_chunk, "prefill_rule": cfg.prefill_rule,
                   "prefix_caching": cfg.prefix_caching, "compare_prefix_caching": cfg.compare_prefix_caching,
                   # multi-turn chat (multi_turn.py); rates_rps are then conversations started per second
                   "conversations": (None if cfg.conversations is None else
                                     {"conversations": cfg.conversations, "turns": cfg.turns, "think_s": cfg.think_s,
                                      "system_chars": cfg.system_chars}),
                   "chat_template": has_chat_template(shared.tokenizer)},
        "simulation": _simulation_settings(shared),
        # the trace-json file as run: name, sha256, rate, classes and their SLOs (before any slo_scale)
        "trace_json": next((p.workload.describe() for p, _ in points if isinstance(p.workload, TraceWorkload)), None),
        "results": rows,
        "adaserve_vs_best_other": ratios,
        **({"draft_regret": regret} if regret else {}),
    }


def _simulation_settings(shared: Shared) -> dict | None:
    if shared.device is None:
        return None
    prof = shared.profile
    return {"device_profile": shared.device.name, "description": shared.device.description,
            "sched_ms": None if shared.sched_s is None else 1e3 * shared.sched_s,
            "sched": "host-measured" if shared.sched_s is None else "fixed",
            "profile": prof.data if prof else None, "device_source": shared.device.source,
            # every draft's price for one token at context 0; drafts after the first are scaled (scaled_draft)
            "draft_t1_ms": {n: 1e3 * p.seconds(1, 0) for n, p in zip(shared.draft_names, shared.draft_prices,
                                                                      strict=False)}}


def plot_report(report: dict, path: Path) -> None:
    """SLO attainment and goodput against rate, one line per policy (like AdaServe Figures 8-9)."""
    from adaserve.plots import panels

    with panels(path, 2) as (fig, (ax1, ax2)):
        _draw_report(report, fig, ax1, ax2)


def _draw_report(report: dict, fig: Any, ax1: Any, ax2: Any) -> None:
    sweep = report["config"].get("sweep", "rate")
    for label in dict.fromkeys(r["policy"] for r in report["results"]):
        rows = sorted((r for r in report["results"] if r["policy"] == label), key=lambda r: r.get("x", r["rate_rps"]))
        xs = [r.get("x", r["rate_rps"]) for r in rows]
        style = {"linewidth": 2.5} if label == "adaserve" else {"linewidth": 1.2}
        ax1.plot(xs, [100 * r["slo_attainment"] for r in rows], "o-", label=label, **style)
        ax2.plot(xs, [r["goodput_tok_s"] for r in rows], "o-", label=label, **style)
    xlabel = SWEEP_LABELS.get(sweep, sweep)
    ax1.set(xlabel=xlabel, ylabel="SLO attainment (%)", ylim=(0, 105), title="SLO attainment")
    ax2.set(xlabel=xlabel, ylabel="goodput (tokens/s)", title="Goodput")
    ax1.legend(fontsize=8)
    name = report["config"].get("model") or Path(report["config"]["target"]).name
    device = report["device"]
    if report.get("clock") == "simulated" and not device.startswith("simulated"):
        device = f"simulated {device}"
    fig.suptitle(f"{name} on {device[:70]}", fontsize=9)


SWEEP_LABELS = {"rate": "request rate (req/s)", "urgent-share": f"share of urgent ({URGENT}) requests",
                "slo-scale": "SLO scale (x every class's TPOT target)"}
