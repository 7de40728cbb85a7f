"""Timing the models: real forwards on the real device, turned into the worker's published profile.

For each n in {1, 2, 4, ...} the target runs a verification-shaped forward: ``b = min(n, 8)``
requests, each with ``context`` cached tokens and a chain of n/b new tokens, timed with device
synchronisation. Two context lengths (64 and 256; on a CPU also 1,024, over 2 requests up to n = 16 where the
cache cannot hold 8: ``probe_plan``) give the samples that separate alpha (per context token) from gamma (per
batched token) in

    T_fwd = alpha * N_context + gamma * N_batched + delta        (SmartSpec Eq. 7)

and the probes of more tokens than requests separate the attention cells' beta * N_cells (cost_model.py).

A start-up profile must not be able to cripple the engine, so the timing is defensive:

- every probe is warmed up, then timed once per round for ``repeats`` rounds, each round in a fresh
  shuffled order (interleaved): a burst of load hits one round of every probe, not every round of a
  few neighbouring probes, and the median over rounds (budget.robust_latency) votes it out;
- the table is checked (budget.check_roofline: monotone within noise, no impossible steps, rounds that
  agree); a table that fails is measured again, at most ``attempts`` times, and one that still fails
  is used for this run only, not cached, with a warning saying why; a cached table that fails the
  check is ignored;
- the budget is never below speculation.adaptive.speculation_floor, what one request needs to speculate.

What the timings mean is decided elsewhere: budget.py picks B at the knee, cost_model.py fits T_fwd,
profile_cache.py keeps the result per device, model identity, dtype and engine version, and timing.py
corrects the cost model from the forwards the engine measures while serving.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import platform
import random
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import torch
from tqdm import tqdm

from adaserve import __version__
from adaserve.engine.checks import at_least
from adaserve.engine.cost.budget import (
    KneeConfig,
    RooflinePoint,
    TableCheck,
    TableVerdict,
    check_roofline,
    choose_budget,
    relative_spread,
    robust_latency,
)
from adaserve.engine.cost.cost_model import CostModel, fit_cost_model
from adaserve.engine.cost.profile_cache import ProfileCache, ProfileKey
from adaserve.engine.model.batch import Segment
from adaserve.engine.model.kv_cache import SequenceKV
from adaserve.engine.model.quant import served_attention, served_kernels, served_weights
from adaserve.engine.model.runner import ModelRunner, chunk_cells
from adaserve.engine.model.tree import TokenTree
from adaserve.engine.speculation.adaptive import speculation_floor

log = logging.getLogger(__name__)

PROBE_SEQUENCES = 8  # the most sequences a probe spreads its new tokens over (fewer: ``probe_plan``)
ATTEMPTS = 3  # measurements of one model before a noisy table is used uncached
ProbeTimer = Callable[[int, int], float]  # (n_tokens, context) -> seconds of one forward
Timings = dict[int, dict[int, list[float]]]  # context -> n_tokens -> seconds, one per round
TimingsIn = Mapping[int, Mapping[int, Sequence[float]]]  # the same, read-only (a recorded table)


@dataclass(frozen=True)
class ProfilerConfig:
    """How profiler.py measures the roofline and the cost-model samples at start-up."""

    max_tokens: int | None = None  # largest n; default 1024 on CUDA, 256 on CPU (memory and time)
    context: int = 256  # representative context length per request for the roofline
    fit_contexts: tuple[int, ...] = (64, 256)  # contexts sampled for the cost-model fit
    # and on a CPU each of these (``probe_plan``): 64 to 256 cached tokens left the cost of a context token loose by
    # up to 2x, and 8 requests at 2,048 over-priced by 38-112% (docs/benchmarks.md, "Twenty-seventh round"); a GPU's
    # profile and the simulated devices keep ``fit_contexts``
    cpu_contexts: tuple[int, ...] = (1024,)
    # each over 8 sequences and the whole grid where the cache holds them, else over 2 up to n = 16 (the default
    # target's 5,824-token cache): chains of up to 8 tokens over 1,024 cached ones separate a cell's cost from a context
    # token's nearly as well (8 sequences up to n = 16 did not: their chains of 1-2 tokens left SmolLM2's long prompt
    # chunks priced 2-5x low, as the narrow span did), at a fraction of the time (docs/benchmarks.md, "Thirtieth round")
    cpu_sequences: int = 2
    cpu_max_tokens: int = 16
    repeats: int = 5
    warmup: int = 2
    knee: KneeConfig = field(default_factory=KneeConfig)

    def __post_init__(self) -> None:
        if self.max_tokens is not None:
            at_least("ProfilerConfig", "max_tokens", self.max_tokens, 1)
        at_least("ProfilerConfig", "context", self.context, 1)
        if not self.fit_contexts:
            raise ValueError("ProfilerConfig.fit_contexts must name at least one context length")
        for c in self.fit_contexts:
            at_least("ProfilerConfig", "fit_contexts", c, 1)
        for c in self.cpu_contexts:
            at_least("ProfilerConfig", "cpu_contexts", c, 1)
        at_least("ProfilerConfig", "cpu_sequences", self.cpu_sequences, 1)
        at_least("ProfilerConfig", "cpu_max_tokens", self.cpu_max_tokens, 1)
        at_least("ProfilerConfig", "repeats", self.repeats, 1)
        at_least("ProfilerConfig", "warmup", self.warmup, 0)


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"cpu:{cpu}:{torch.get_num_threads()}threads"


def model_identity(path: Path) -> str:
    """A content hash of the config and the weight files' names and sizes (cheap; no weight hashing)."""
    h = hashlib.sha256((path / "config.json").read_bytes())
    for f in sorted(path.glob("*.safetensors")):
        h.update(f"{f.name}:{f.stat().st_size}".encode())
    return h.hexdigest()[:16]


# ---- timing one forward --------------------------------------------------------------------------


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def probe_split(n_tokens: int, most: int = PROBE_SEQUENCES) -> list[int]:
    """A probe's new tokens per request: ``n_tokens`` over ``b = min(n, most)`` requests, as evenly as they go."""
    b = min(n_tokens, most)
    return [n_tokens // b + (1 if i < n_tokens % b else 0) for i in range(b)]


@contextlib.contextmanager
def _probe(runner: ModelRunner, n_tokens: int, context: int,
           most: int = PROBE_SEQUENCES) -> Iterator[list[Segment]]:
    """``b = min(n, most)`` requests with ``context`` cached tokens and n/b new ones; their KV freed after."""
    per = probe_split(n_tokens, most)
    b = len(per)
    cache = runner.cache
    seqs = [SequenceKV() for _ in range(b)]
    try:
        for s in seqs:  # the prefix only needs to exist in the cache: its values do not matter for time
            cache.ensure(s, context)
            cache.truncate(s, context)
        yield [Segment(s, context, TokenTree.chain([1] * k)) for s, k in zip(seqs, per, strict=True)]
    finally:
        for s in seqs:
            cache.release(s)


def _timed(runner: ModelRunner, segs: list[Segment]) -> float:
    _sync(runner.device)
    t0 = time.perf_counter()
    runner.forward(segs, all_logits=[True] * len(segs))
    _sync(runner.device)
    return time.perf_counter() - t0


def forward_timer(runner: ModelRunner, most: Mapping[int, int] | None = None) -> ProbeTimer:
    """Seconds of one real forward of ``runner`` over ``n_tokens`` new tokens at ``context``, spread over at most
    ``most[context]`` sequences (default ``PROBE_SEQUENCES``: ``ProbePlan.most``)."""
    most = most or {}

    def time_one(n_tokens: int, context: int) -> float:
        with _probe(runner, n_tokens, context, most.get(context, PROBE_SEQUENCES)) as segs:
            return _timed(runner, segs)

    return time_one


def time_forward(runner: ModelRunner, *, n_tokens: int, context: int, repeats: int, warmup: int) -> float:
    """Median seconds of one forward carrying ``n_tokens`` new tokens over ``context``-token prefixes."""
    with _probe(runner, n_tokens, context) as segs:
        samples = [_timed(runner, segs) for _ in range(warmup + repeats)]
    return robust_latency(samples[warmup:])


def measure_interleaved(timer: ProbeTimer, probes: Sequence[tuple[int, int]], *, rounds: int, warmup: int,
                        seed: int = 0, on_probe: Callable[[], None] | None = None) -> Timings:
    """Every (context, n) probe warmed up ``warmup`` times, then timed once in each of ``rounds`` rounds.

    Each round visits the probes in its own shuffled order, so slow spells of the machine spread over
    all probes instead of piling onto neighbours on the grid (which would bend the curve).
    """
    for c, n in probes:
        for _ in range(warmup):
            timer(n, c)
    out: Timings = {}
    rng = random.Random(seed)
    for _ in range(rounds):
        order = list(probes)
        rng.shuffle(order)
        for c, n in order:
            out.setdefault(c, {}).setdefault(n, []).append(timer(n, c))
            if on_probe is not None:
                on_probe()
    return out


# ---- what the timings say ------------------------------------------------------------------------


def _roofline(timings: Mapping[int, Sequence[float]]) -> list[RooflinePoint]:
    return [RooflinePoint(n, robust_latency(xs)) for n, xs in sorted(timings.items())]


def check_timings(timings: TimingsIn, check: TableCheck | None = None) -> TableVerdict:
    """Every context's table checked (budget.check_roofline): all of them feed the cost model."""
    problems: list[str] = []
    for c in sorted(timings):
        verdict = check_roofline(_roofline(timings[c]), timings[c], check)
        problems += [f"context {c}: {p}" for p in verdict.problems]
    return TableVerdict(tuple(problems))


def summarise_timings(timings: TimingsIn, *, context: int, knee: KneeConfig | None = None,
                      check: TableCheck | None = None, most: Mapping[int, int] | None = None) -> dict[str, Any]:
    """Roofline table at ``context``, knee budget, cost-model fit and the check's verdict, as JSON data.

    Pure: feed it recorded tables. ``most``: the most sequences each context's probes were spread over (default
    ``PROBE_SEQUENCES``; ``ProbePlan.most``). ``budget`` is the knee of the table; the floor is applied by the
    caller (profile_models), which knows what the engine needs.
    """
    most = most or {}
    points = _roofline(timings[context])
    verdict = check_timings(timings, check)
    # cost-model samples: b = min(n, most) requests of c cached tokens each -> N_context = b * c, and each request's
    # chain of k new tokens reads its c and the chain up to itself -> N_cells = sum chunk_cells(k, c) (n * c + n
    # up to b tokens: the larger probes separate beta from alpha, cost_model.py)
    samples = [(len(split) * c, p.n_tokens, p.latency_s, sum(chunk_cells(k, c) for k in split))
               for c in sorted(timings) for p in _roofline(timings[c])
               for split in [probe_split(p.n_tokens, most.get(c, PROBE_SEQUENCES))]]
    budget = choose_budget(points, knee)
    cost, report = fit_cost_model(samples, knee=budget)  # bent at the knee (cost_model.py)
    return {
        "table": [{"n_tokens": p.n_tokens, "latency_ms": 1e3 * p.latency_s, "tokens_per_s": p.n_tokens / p.latency_s,
                   "spread": relative_spread(timings[context][p.n_tokens]),
                   "rounds_ms": [1e3 * x for x in timings[context][p.n_tokens]]} for p in points],
        "budget": budget,
        "context": context,
        "cost_model": cost.to_dict(),
        "fit": report.to_dict(),
        "check": {"ok": verdict.ok, "problems": list(verdict.problems)},
    }


def size_grid(limit: int) -> list[int]:
    """n = 1, 2, 4, ... up to ``limit``: the sizes the profiler times (and the simulation prices)."""
    out, n = [], 1
    while n <= limit:
        out.append(n)
        n *= 2
    return out


def _room(runner: ModelRunner, longest: int) -> int:
    """New tokens a probe can add to 8 sequences of ``longest`` cached tokens: memory-safe, every probe's prefixes
    and new tokens must fit in the preallocated cache (with half of it to spare)."""
    return runner.cache.capacity_tokens // 2 - PROBE_SEQUENCES * longest


def _probe_limit(runner: ModelRunner, cfg: ProfilerConfig) -> int:
    """The largest n probed over ``context`` and ``fit_contexts``."""
    default_max = 1024 if runner.device.type == "cuda" else 256
    return min(cfg.max_tokens or default_max, max(1, _room(runner, max(cfg.context, *cfg.fit_contexts))))


class ProbePlan(NamedTuple):
    """Where a profile's probes run: the cached tokens of each probe context, the largest n of the grid, and per
    context the most sequences a probe's tokens are spread over (``PROBE_SEQUENCES``, or a CPU context's
    ``cpu_sequences``, fewer where the cache holds fewer beside its largest probe) and its largest n (``limit``, or a
    CPU context's ``cpu_max_tokens``)."""

    contexts: tuple[int, ...]
    limit: int
    most: dict[int, int]
    top: dict[int, int]

    def label(self) -> str:
        """The contexts as the profile key names them: ``64,256,1024``, one over 2 sequences up to n = 16 as
        ``1024x2:16``."""
        return ",".join(context_label(c, self.most[c], None if self.top[c] == self.limit else self.top[c])
                        for c in self.contexts)


def context_label(context: int, sequences: int, top: int | None) -> str:
    """One probe context as ``ProbePlan.label`` names it: ``1024``, or ``1024x2`` over fewer than 8 sequences, with
    ``:16`` when its probes stop at n = 16 (``top``; None: the whole grid)."""
    return f"{context}{'' if sequences == PROBE_SEQUENCES else f'x{sequences}'}{'' if top is None else f':{top}'}"


def probe_plan(runner: ModelRunner, cfg: ProfilerConfig) -> ProbePlan:
    """The contexts the probes run at, their sequences and largest n: ``context`` and ``fit_contexts`` over 8
    sequences and the grid up to ``limit``; on a CPU also each of ``cpu_contexts``, the same way where the cache holds
    8 sequences of it beside the grid, else up to ``cpu_max_tokens`` over ``cpu_sequences`` sequences, or as many as
    the cache holds beside them (none: not probed)."""
    limit = _probe_limit(runner, cfg)
    most = dict.fromkeys({cfg.context, *cfg.fit_contexts}, PROBE_SEQUENCES)
    top = dict.fromkeys(most, limit)
    if runner.device.type == "cpu":
        n = min(limit, cfg.cpu_max_tokens)
        for c in (c for c in cfg.cpu_contexts if c not in most):
            if _room(runner, c) >= limit:
                most[c], top[c] = PROBE_SEQUENCES, limit
            elif (fits := min(cfg.cpu_sequences, (runner.cache.capacity_tokens // 2 - n) // c)) >= 1:
                most[c], top[c] = fits, n  # fits sequences of c cached tokens leave room for n new (as _room)
    return ProbePlan(tuple(sorted(most)), limit, most, top)


def probe_grid(runner: ModelRunner, cfg: ProfilerConfig) -> list[tuple[int, int]]:
    """Every probe of a profile, (cached tokens, new tokens): each of ``probe_plan``'s contexts over the grid of n up
    to its largest."""
    plan = probe_plan(runner, cfg)
    return [(c, n) for c in plan.contexts for n in size_grid(plan.top[c])]


def profile_runner(runner: ModelRunner, cfg: ProfilerConfig, *, label: str, progress: bool = True,
                   check: TableCheck | None = None, attempts: int = ATTEMPTS,
                   timer: ProbeTimer | None = None) -> dict[str, Any]:
    """Roofline table, knee budget and cost-model fit for one model, re-measured while the table is noisy.

    ``timer`` replaces the real forwards (recorded tables, tests). When every attempt fails the check, the
    one with the fewest problems is returned. Its ``check`` says whether it passed and how many attempts
    were made; a caller must not cache a failed one.
    """
    if attempts < 1:
        raise ValueError(f"attempts must be >= 1, got {attempts}")
    plan = probe_plan(runner, cfg)
    timer = timer or forward_timer(runner, plan.most)
    probes = probe_grid(runner, cfg)
    t0 = time.perf_counter()
    best: dict[str, Any] | None = None
    for attempt in range(1, attempts + 1):
        with tqdm(total=len(probes) * cfg.repeats, desc=f"profiling {label}", disable=not progress,
                  unit="probe") as bar:
            timings = measure_interleaved(timer, probes, rounds=cfg.repeats, warmup=cfg.warmup, seed=attempt,
                                          on_probe=bar.update)
        out = summarise_timings(timings, context=cfg.context, knee=cfg.knee, check=check, most=plan.most)
        problems = out["check"]["problems"]
        if best is None or len(problems) < len(best["check"]["problems"]):  # the least implausible so far
            best = out
        if not problems:
            break
        log.warning("profile of the %s, attempt %d of %d, is too noisy to trust (%s)%s", label, attempt, attempts,
                    TableVerdict(tuple(problems)).reason(), ": measuring again" if attempt < attempts else "")
    assert best is not None  # attempts >= 1
    best["check"]["attempts"] = attempt
    best["seconds"] = time.perf_counter() - t0
    return best


# ---- the profile a worker runs with --------------------------------------------------------------


@dataclass(frozen=True)
class Profile:
    """What a worker publishes: the budget, both cost models, and how they were measured.

    ``budget`` is the knee of the target's table raised to ``budget_floor`` (adaptive.speculation_floor);
    ``problems`` is empty unless the table was still noisy after every attempt (then it is not cached).
    """

    device: str
    budget: int
    target_cost: CostModel
    draft_cost: CostModel | None
    data: dict[str, Any]
    cached: bool
    budget_floor: int = 1
    problems: tuple[str, ...] = ()

    @property
    def knee(self) -> int:
        return int(self.data["target"]["budget"])

    def to_dict(self) -> dict[str, Any]:
        return {**self.data, "cached": self.cached, "budget": self.budget, "budget_floor": self.budget_floor,
                "problems": list(self.problems)}


def _stored_rounds(table: Sequence[Mapping[str, Any]]) -> dict[int, list[float]] | None:
    """The rounds a stored table was measured in (seconds per n), when it kept them (older files did not)."""
    if not all("rounds_ms" in r for r in table):
        return None
    return {int(r["n_tokens"]): [float(x) / 1e3 for x in r["rounds_ms"]] for r in table}


def _stored_problems(data: Mapping[str, Any], check: TableCheck | None) -> list[str]:
    """Why a stored profile cannot be used: a missing part, or a table that fails the check."""
    problems: list[str] = []
    for name in ("target", "draft"):
        part = data.get(name)
        if part is None:
            continue
        try:
            int(part["budget"])
            CostModel.from_dict(part["cost_model"])
            points = [RooflinePoint(int(r["n_tokens"]), float(r["latency_ms"]) / 1e3) for r in part["table"]]
            verdict = check_roofline(points, _stored_rounds(part["table"]), check=check)
        except (KeyError, TypeError, ValueError) as e:
            problems.append(f"{name}: unreadable ({e!r})")
            continue
        if part.get("check", {}).get("ok") is False:  # written by hand, or by an older engine
            problems.append(f"{name}: marked noisy when measured")
        problems += [f"{name}: {p}" for p in verdict.problems]
    if "target" not in data:
        problems.append("no target table")
    return problems


def _load_checked(cache: ProfileCache, key: ProfileKey, check: TableCheck | None) -> dict[str, Any] | None:
    data = cache.load(key)
    if data is None:
        return None
    problems = _stored_problems(data, check)
    if problems:
        log.warning("ignoring the cached profile %s: %s; profiling again", cache.path_for(key),
                    TableVerdict(tuple(problems)).reason())
        return None
    return data


def profile_models(target: ModelRunner, draft: ModelRunner | None, *, target_path: Path,
                   draft_path: Path | None, cfg: ProfilerConfig | None = None, cache: ProfileCache | None = None,
                   force: bool = False, progress: bool = True,
                   clock: Callable[[], float] = time.perf_counter, min_budget: int | None = None,
                   check: TableCheck | None = None, attempts: int = ATTEMPTS,
                   timers: tuple[ProbeTimer, ProbeTimer | None] | None = None) -> Profile:
    """The cached profile when one passes the check, else a fresh one (cached only when it passes).

    ``min_budget``: the least B the engine needs (default: adaptive.speculation_floor of the default
    adaptive bounds; pass the engine's own when it has others). ``timers`` (target, draft) replace the
    real forwards: recorded tables, tests.
    """
    cfg = cfg or ProfilerConfig()
    cache = cache or ProfileCache()
    floor = speculation_floor() if min_budget is None else min_budget
    dev = device_name(target.device)
    ident = model_identity(target_path) + ("+" + model_identity(draft_path) if draft_path else "")
    served = [served_weights(r.model) for r in (target, draft) if r is not None]
    if any(w != "float" for w in served):  # one checkpoint quantized at load is another model (quant.py)
        ident += ":weights=" + "/".join(served)
        # and its costs are those of the kernels it runs on: torch's, or the integer kernels of one build (their
        # library's name hashes its sources, flags and compiler), so a kernel change measures afresh
        ident += ":kernels=" + "/".join(served_kernels(r.model) for r in (target, draft) if r is not None)
    else:  # float: its forwards cost what its attention runs on, SDPA or the native kernels of one build
        attention = [served_attention(r.model) for r in (target, draft) if r is not None]
        if any(a != "sdpa" for a in attention):
            ident += ":attention=" + "/".join(attention)
    if target.tensor_parallel_size > 1:  # a sharded target is another engine: its own B and cost model
        ident += f":tp={target.tensor_parallel_size}"
    knee = f"{cfg.knee.criterion}:{cfg.knee.max_elasticity}:{cfg.knee.eps}"
    contexts = probe_plan(target, cfg).label()  # a profile over other contexts (or sequences) is another fit
    key = ProfileKey(device=dev, model=ident + f":ctx{cfg.context}:max{cfg.max_tokens}:knee={knee}:fit{contexts}",
                     dtype=str(target.dtype).removeprefix("torch."), engine_version=__version__)
    data = None if force else _load_checked(cache, key, check)
    cached = data is not None
    problems: list[str] = []
    if data is None:
        data, problems = _measure(target, draft, cfg, dev=dev, key=key, check=check, attempts=attempts,
                                  timers=timers, progress=progress, clock=clock)
        _keep(cache, key, data, problems, floor)
    draft_cost = CostModel.from_dict(data["draft"]["cost_model"]) if "draft" in data else None
    knee_b = int(data["target"]["budget"])
    if knee_b < floor:
        log.info("budget raised from the knee %d to %d: what one request needs to speculate", knee_b, floor)
    return Profile(device=dev, budget=max(knee_b, floor),
                   target_cost=CostModel.from_dict(data["target"]["cost_model"]), draft_cost=draft_cost,
                   data=data, cached=cached, budget_floor=floor, problems=tuple(problems))


def _measure(target: ModelRunner, draft: ModelRunner | None, cfg: ProfilerConfig, *, dev: str, key: ProfileKey,
             check: TableCheck | None, attempts: int, timers: tuple[ProbeTimer, ProbeTimer | None] | None,
             progress: bool, clock: Callable[[], float]) -> tuple[dict[str, Any], list[str]]:
    """Both models profiled; the problems of any table still noisy after its last attempt."""
    t_timer, d_timer = timers if timers is not None else (None, None)
    t0 = clock()
    data: dict[str, Any] = {"device": dev, "key": key.to_dict()}
    parts = [("target", target, t_timer)] + ([("draft", draft, d_timer)] if draft is not None else [])
    problems: list[str] = []
    for name, runner, timer in parts:
        data[name] = profile_runner(runner, cfg, label=name, progress=progress, check=check, attempts=attempts,
                                    timer=timer)
        problems += [f"{name}: {p}" for p in data[name]["check"]["problems"]]
    data["profiling_seconds"] = clock() - t0
    return data, problems


def _keep(cache: ProfileCache, key: ProfileKey, data: dict[str, Any], problems: list[str], floor: int) -> None:
    """Cache a clean profile; say loudly why a noisy one is used for this run only."""
    if problems:
        log.warning("the profile is still too noisy after every attempt (%s): it is used for this run only, "
                    "not cached, with B at least %d; the engine corrects its cost model from the forwards it "
                    "measures. Profile again on a quieter machine (adaserve profile --force).",
                    TableVerdict(tuple(problems)).reason(), floor)
        return
    cache.save(key, data)
    log.info("profiled on %s in %.1fs: knee budget %d", data["device"], data["profiling_seconds"],
             data["target"]["budget"])


def plot_profile(data: dict[str, Any], path: Path) -> None:
    """Latency and tokens/s against n (log scale), the chosen budget marked, one panel per model."""
    from adaserve.plots import panels

    models = [m for m in ("target", "draft") if m in data]
    with panels(path, len(models), width=6) as (_, axes):
        for ax, name in zip(axes, models, strict=True):
            _plot_model(ax, data, name)


def _plot_model(ax: Any, data: dict[str, Any], name: str) -> None:
    rows = data[name]["table"]
    n = [r["n_tokens"] for r in rows]
    ax.plot(n, [r["latency_ms"] for r in rows], "o-", color="tab:blue", label="latency (ms)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tokens per forward (n)")
    ax.set_ylabel("latency (ms)", color="tab:blue")
    ax2 = ax.twinx()
    ax2.plot(n, [r["tokens_per_s"] for r in rows], "s--", color="tab:green", label="tokens/s")
    ax2.set_ylabel("tokens / s", color="tab:green")
    ax.axvline(data[name]["budget"], color="tab:red", linestyle=":", label=f"B = {data[name]['budget']}")
    ax.set_title(f"{name} on {data['device'][:40]}")
    ax.legend(loc="upper left")


def summary_json(profile: Profile) -> str:
    return json.dumps(profile.to_dict(), indent=2)
