"""The engine's own cost: per iteration, the time spent outside model forwards, as a share of the iteration.

    for each (speculation on/off, batch n):   n requests decoding at once on a fresh engine
        prefill every prompt, run ``warmup`` iterations, then time ``steps`` iterations:
            t_step                 the whole ``Engine.step()``
            t_forward              inside the target's and the draft's ``CausalLM.forward`` (ForwardClock)
            non-forward share      (t_step - t_forward) / t_step      scheduling, selection, tree
                                   building, batch layout, verification walk, KV commit, bookkeeping

The forward time is taken by wrapping the models' ``forward``, not by anything the engine reports, so the
same module measures any version of the engine (the before/after table in docs/benchmarks.md).

After the timed iterations, ``count_steps`` more run under ``host_sync.HostSync``, which counts per
iteration every call that on a GPU makes the host wait for the device (``h2d``, ``d2h``, ``data_shape``,
``sync``) or copies without waiting (``async_copy``), with the code location of each. Counting runs every
torch call through Python, so it has its own iterations and never touches the timed ones. The same iterations count
the device operations (``OpCount``: aten calls that are not views, each a kernel launch on a GPU) inside the models'
forwards and outside them: on a GPU each one outside costs the host a launch, whatever the device does, so their
number is the CPU's measure of the host work a GPU iteration cannot hide. They run with the torch ops a GPU runs for
the beam picks and the greedy argmax (``torch_picks``), which the CPU kernels do in one call each on a CPU.
Speculation on is the ``adaserve`` policy (adaptive depth and width, Eq. 8-9) at a fixed budget; off is
``incremental`` (continuous batching). Greedy, ``ignore_eos``: every request keeps decoding.

    python -m adaserve.bench.engine_only --json docs/results/engine-only-cpu-smollm2.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any
from unittest import mock

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from adaserve import allocator
from adaserve.bench.microbench_options import (
    MODES,
    EngineOnlyConfig,
    add_common,
    add_engine_only,
    engine_only_config,
)
from adaserve.engine.config import EngineConfig
from adaserve.engine.engine import Engine
from adaserve.engine.model import native_kernels
from adaserve.engine.model.host_sync import BLOCKING, KINDS, HostSync
from adaserve.engine.model.kv_cache import KVCacheConfig
from adaserve.engine.model.quant import served_attention, served_description
from adaserve.engine.model.runner import ModelRunner
from adaserve.engine.request import Phase, Request
from adaserve.engine.speculation.draft_steps import DraftSteps
from adaserve.engine.speculation.sampling import SamplingParams


def wrap_attribute(obj: Any, name: str,
                   wrapper: Callable[[Callable[..., Any]], Callable[..., Any]]) -> Callable[[], None]:
    """Set ``obj.<name>`` to ``wrapper(obj.<name>)`` as an attribute of the instance and return what undoes it: the
    instance's own attribute found before (another wrapper's, a library's loaded function), or none, so the class's
    shows again. Wrappers nest and come off in turn (``ForwardClock``, ``OpCount`` on a model's ``forward``, which
    the engine calls: runner.py; ``ScanClock`` on the CPU kernels' functions)."""
    found = obj.__dict__.get(name)
    setattr(obj, name, wrapper(getattr(obj, name)))

    def restore() -> None:
        if found is None:
            obj.__dict__.pop(name, None)
        else:
            obj.__dict__[name] = found

    return restore


class ForwardClock:
    """Seconds spent inside one model's forwards.

    On a CPU: wall time around the module's ``forward``, which the clock wraps for as long as it lives (an attribute
    of the instance, which the engine calls, as ``nn.Module.__call__`` would the method). Not forward hooks: the
    engine does not call the module (runner.py), and with hooks ``nn.Module`` takes its slow call path, whose work
    (the hooks' dispatch, the closures it runs them in) lands mostly outside the span: the time outside the
    forwards read up to tens of us a forward that a served engine never pays (issue 30; docs/benchmarks.md,
    thirty-fourth round). On CUDA: the model's own device timer (``CausalLM.timer``, CUDA events around every eager
    forward and every graph replay), read after the iteration's copy back has waited for the device: the device time
    of the forwards, without synchronising anything (a graph replay never passes through the module's ``forward``,
    and a synchronise would change what is measured).
    ``cpu_seconds``: the process's CPU time inside the wrapped forwards (every thread), which other work on a shared
    machine inflates far less (with one torch thread, not at all).
    """

    def __init__(self, module: nn.Module) -> None:
        self._wall = self.cpu_seconds = 0.0
        self.calls = 0
        timer = getattr(module, "timer", None)
        self._device_timer = timer if next(module.parameters()).is_cuda and timer is not None else None
        self._base = self._device_timer.seconds if self._device_timer is not None else 0.0
        self._restore = wrap_attribute(module, "forward", self._timed)

    def _timed(self, forward: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            # the CPU clock's reads (a system call each, ~0.7 us warm) inside the wall span, so they are not charged
            # to the engine's time outside the forwards: only the wall clock's (vDSO, ~60 ns) are
            t0 = time.perf_counter()
            c0 = time.process_time()
            try:
                return forward(*args, **kwargs)
            finally:
                self.cpu_seconds += time.process_time() - c0
                self._wall += time.perf_counter() - t0
                self.calls += 1

        return timed

    @property
    def seconds(self) -> float:
        if self._device_timer is not None:
            return self._device_timer.seconds - self._base
        return self._wall

    def remove(self) -> None:
        """The module's ``forward`` as it was before this clock (its own, or an earlier clock's wrapper)."""
        self._restore()


class ScanClock:
    """Seconds spent in the CPU kernels' scans of the vocabulary, outside the forwards: the draft's beam picks (a
    log-softmax and a top-k over each frontier row's V logits) and the verification's greedy argmax over every tree
    node's V logits (native/picks.c). On a GPU these are device kernels, as the forwards are; on a CPU they are the
    host's, and with a large vocabulary (SmolLM2's 49,152 against the demo pair's 4,096) they are much of the time
    outside the forwards at many requests (issue 30; docs/benchmarks.md, thirty-sixth round). Timed around the
    library's two C entry points themselves (the ctypes functions, set on the loaded library for as long as the clock
    lives and put back by ``remove``), so no Python of the engine's is counted; 0 where the kernels do not serve.
    An int8 head on the kernels finds its rows' greedy draws inside the forward (``head_refine``): there the
    verification makes no scan to time."""

    NAMES = ("beam_picks", "first_argmax")

    def __init__(self, kernels: native_kernels.NativeKernels | None) -> None:
        self.seconds = 0.0
        self.calls = 0
        # ``load`` typed each function, so the library holds it as its own attribute: that one is put back
        self._restores = [] if kernels is None else [wrap_attribute(kernels.lib, n, self._timed) for n in self.NAMES]

    def _timed(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args)
            finally:
                self.seconds += time.perf_counter() - t0
                self.calls += 1

        return timed

    def remove(self) -> None:
        """The library's own functions again."""
        for restore in reversed(self._restores):
            restore()
        self._restores = []


@dataclass(frozen=True)
class IterationTimes:
    """One timed iteration, in seconds (``draft_fwd`` is 0 without speculation)."""

    step: float
    target_fwd: float
    draft_fwd: float
    speculate: float  # StepMetrics.t_speculate_s: draft forwards + tree building
    select: float
    verify: float  # StepMetrics.t_verify_s: target forward + walk + commit
    tokens: int  # tokens emitted
    cpu_step: float = 0.0  # the same iteration and forwards in process CPU time
    cpu_fwd: float = 0.0
    # what the policy chose, and what the engine's cost models priced (``Engine.predict_iteration``: the forwards
    # alone, as the shape rules weigh them unless ``host_cost``): its tree, and plain decoding at the same moment
    depth: int = 0
    width: int = 0
    predicted: float = 0.0
    predicted_plain: float = 0.0
    scans: float = 0.0  # inside the CPU kernels' vocabulary scans (ScanClock), outside the forwards

    @property
    def forward(self) -> float:
        return self.target_fwd + self.draft_fwd

    @property
    def non_forward(self) -> float:
        return self.step - self.forward


def summarize_cell(its: Sequence[IterationTimes]) -> dict[str, Any]:
    """Aggregates of one cell's iterations: share = sum(non-forward) / sum(step), per-iteration ms; the shapes the
    policy chose (``"DxW"``, ``"plain"``) with their counts, and what the cost models predicted for them."""
    total = sum(i.step for i in its)
    shares = [i.non_forward / i.step for i in its]
    n = len(its)

    def ms(xs: Sequence[float]) -> float:
        return 1e3 * sum(xs) / n

    return {
        "non_forward_share": sum(i.non_forward for i in its) / total,
        "median_iteration_share": statistics.median(shares),
        "iteration_ms": ms([i.step for i in its]),
        "forward_ms": ms([i.forward for i in its]),
        "non_forward_ms": ms([i.non_forward for i in its]),
        # the CPU kernels' vocabulary scans (a GPU's device work: ScanClock), and the time outside the forwards
        # without them
        "vocab_scan_ms": ms([i.scans for i in its]),
        "non_forward_less_scans_ms": ms([i.non_forward - i.scans for i in its]),
        # where the non-forward time goes (each without the forwards it contains)
        "speculate_other_ms": ms([i.speculate - i.draft_fwd for i in its]),
        "select_ms": ms([i.select for i in its]),
        "verify_other_ms": ms([i.verify - i.target_fwd for i in its]),
        "rest_ms": ms([i.step - i.speculate - i.select - i.verify for i in its]),
        "non_forward_share_cpu": 1.0 - sum(i.cpu_fwd for i in its) / max(sum(i.cpu_step for i in its), 1e-12),
        # the same host time in process CPU time: other work on a shared machine hardly moves it
        "non_forward_cpu_ms": ms([i.cpu_step - i.cpu_fwd for i in its]),
        "tokens_per_iteration": sum(i.tokens for i in its) / n,
        # process CPU time per emitted token (a request's TPOT is this times the batch): the cells' yardstick
        "cpu_ms_per_token": 1e3 * sum(i.cpu_step for i in its) / max(sum(i.tokens for i in its), 1),
        "tokens_per_s": sum(i.tokens for i in its) / total,
        # why a policy drafted where plain decoding was faster (issue 30's GPU run): the shapes it chose, the
        # forwards it expected them to cost against the forwards measured, and what it expected of plain decoding
        "shapes": dict(sorted(Counter(f"{i.depth}x{i.width}" if i.depth else "plain" for i in its).items())),
        "predicted_iteration_ms": ms([i.predicted for i in its]),
        "predicted_plain_iteration_ms": ms([i.predicted_plain for i in its]),
    }


def prompts(tokenizer: Any, n: int, max_tokens: int) -> list[list[int]]:
    """``n`` chat-formatted prompts (coding, then chat), each cut to its last ``max_tokens`` tokens."""
    from adaserve.bench.workload import chat_prompts, humaneval_prompts
    from adaserve.engine.loading.chat import instruction_ids

    pool = [*humaneval_prompts()[:64], *chat_prompts()[:64]]
    return [instruction_ids(tokenizer, pool[i % len(pool)])[-max_tokens:] for i in range(n)]


def run_cell(target: ModelRunner, draft: ModelRunner, prompt_ids: list[list[int]], *, mode: str,
             cfg: EngineOnlyConfig, served: EngineConfig | None = None) -> tuple[list[IterationTimes], dict[str, Any]]:
    """Decode ``len(prompt_ids)`` requests together; time ``cfg.steps`` iterations after prefill and warm-up,
    then count host-device crossings over ``cfg.count_steps`` more (:func:`count_crossings`). ``served``: the
    budget, cost models and tree bounds of the pair's start-up profile (``served_config``); None: ``cfg.budget``
    and cost models that start from a flat guess."""
    base = served if served is not None else EngineConfig(budget=cfg.budget)
    ecfg = replace(base, policy=MODES[mode], max_batch=max(64, len(prompt_ids)), host_cost=cfg.host_cost)
    eng = Engine(target, draft if mode != "plain" else None, ecfg)
    longest = (cfg.warmup_steps + cfg.steps + cfg.count_steps + 2) * (ecfg.adaptive.d_max + 1)
    for i, ids in enumerate(prompt_ids):
        eng.add_request(Request(f"r{i}", ids, SamplingParams(max_tokens=longest, ignore_eos=True)))
    while eng.waiting or any(r.phase is not Phase.DECODE for r in eng.running):
        eng.step()
    for _ in range(cfg.warmup_steps):
        eng.step()
    clocks = (ForwardClock(target.model), ForwardClock(draft.model))
    scans = ScanClock(native_kernels.chosen() if target.device.type == "cpu" else None)
    out = []
    try:
        for _ in range(cfg.steps):
            # plain decoding's price as the engine sees it now (every request decoding: no prefill is left)
            plain = eng.predict_iteration(None, len(eng.running), sum(r.target_kv.length for r in eng.running))
            f0 = [c.seconds for c in clocks]
            c0 = sum(c.cpu_seconds for c in clocks)
            s0 = scans.seconds
            t0, p0 = time.perf_counter(), time.process_time()
            eng.step()
            t, cpu = time.perf_counter() - t0, time.process_time() - p0
            m = eng.history[-1]
            out.append(IterationTimes(step=t, target_fwd=clocks[0].seconds - f0[0],
                                      draft_fwd=clocks[1].seconds - f0[1], speculate=m.t_speculate_s,
                                      select=m.t_select_s, verify=m.t_verify_s, tokens=m.tokens_emitted,
                                      cpu_step=cpu, cpu_fwd=sum(c.cpu_seconds for c in clocks) - c0,
                                      depth=m.depth, width=m.width, predicted=m.predicted_iter_s,
                                      predicted_plain=plain, scans=scans.seconds - s0))
    finally:
        scans.remove()
        for c in clocks:
            c.remove()
    try:
        crossings = count_crossings(eng, cfg.count_steps)
    finally:
        for r in list(eng.running):
            eng.abort(r.request_id)
    return out, crossings


class OpCount(TorchDispatchMode):
    """Device operations (aten calls that are not views: a kernel launch each on a GPU), counted apart inside the
    given models' forwards and outside them, with the most frequent outside by name."""

    def __init__(self, models: Sequence[nn.Module]) -> None:
        super().__init__()
        self.inside = self.outside = 0
        self.names: Counter[str] = Counter()
        self._models, self._depth = list(models), 0
        self._restores: list[Callable[[], None]] = []

    def __enter__(self) -> OpCount:  # the models' ``forward`` wrapped as long as the mode (``wrap_attribute``)
        self._restores = [wrap_attribute(m, "forward", self._counted) for m in self._models]
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        for restore in reversed(self._restores):
            restore()
        super().__exit__(*exc)

    def _counted(self, forward: Callable[..., Any]) -> Callable[..., Any]:
        def inside(*args: Any, **kwargs: Any) -> Any:
            self._in()
            try:
                return forward(*args, **kwargs)
            finally:
                self._out()
        return inside

    def _in(self, *_: Any) -> None:
        self._depth += 1

    def _out(self, *_: Any) -> None:
        self._depth -= 1

    @contextlib.contextmanager
    def replay(self) -> Any:
        """A region a GPU replays as one CUDA graph (the draft's steps, draft_steps.py; a CPU calls its function):
        counted as one launch outside the forwards, its own ops as inside."""
        self.outside += 1
        self.names["graph_replay"] += 1
        self._in()
        try:
            yield
        finally:
            self._out()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if not func.is_view:
            if self._depth:
                self.inside += 1
            else:
                self.outside += 1
                self.names[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def torch_picks() -> contextlib.AbstractContextManager[Any]:
    """Beam picks and greedy argmax by the torch ops a GPU launches, not the CPU kernels' one call each
    (``native_kernels.ENV`` off, read at each call; layers already built keep their kernels), the environment
    restored after: what the counts below stand for is a GPU iteration's launches."""
    return mock.patch.dict(os.environ, {native_kernels.ENV: "off"})


@contextlib.contextmanager
def steps_as_replays(ops: OpCount) -> Any:
    """The draft's steps on static buckets counted as the one graph replay a GPU makes of a search's steps
    (``OpCount.replay``)."""
    steps = DraftSteps._steps

    def counted(self: DraftSteps, levels: Any, on_forward: Any) -> None:
        with ops.replay():
            steps(self, levels, on_forward)

    with mock.patch.object(DraftSteps, "_steps", counted):
        yield


def count_crossings(eng: Engine, steps: int) -> dict[str, Any]:
    """Per iteration, over ``steps`` iterations: host-device crossings of each kind (host_sync.py), the
    blocking ones together, and where in the code each comes from (calls per iteration); and the device
    operations inside the models' forwards and outside them (``OpCount``), the ten most frequent outside."""
    if steps < 1:
        return {}
    models = [r.model for r in (eng.target, *([] if eng.draft is None else [eng.draft]))]
    with torch_picks(), HostSync() as hs, OpCount(models) as ops, steps_as_replays(ops):
        for _ in range(steps):
            eng.step()
    per = {f"{k}_per_iteration": hs.counts[k] / steps for k in KINDS}
    per["blocking_per_iteration"] = sum(hs.counts[k] for k in BLOCKING) / steps
    per["where_per_iteration"] = {w: n / steps for w, n in hs.where.most_common()}
    per["ops_outside_forwards_per_iteration"] = ops.outside / steps
    per["ops_inside_forwards_per_iteration"] = ops.inside / steps
    per["ops_outside_by_name_per_iteration"] = {k: n / steps for k, n in ops.names.most_common(10)}
    return per


def served_config(target: ModelRunner, draft: ModelRunner, model: str) -> EngineConfig:
    """What ``build_engine`` gives a served engine of ``model``'s pair from its start-up profile (cost/profiler.py,
    cached per machine): the budget, both cost models and the tree bounds the profiled draft:target ratio allows."""
    from adaserve.engine.build import with_profile
    from adaserve.engine.cost.profiler import profile_models
    from adaserve.engine.loading.catalog import resolve

    pair = resolve(model, progress=False)
    return with_profile(EngineConfig(), profile_models(target, draft, target_path=pair.target,
                                                      draft_path=pair.draft, progress=False))


def run_engine_only(target: ModelRunner, draft: ModelRunner, tokenizer: Any, cfg: EngineOnlyConfig, *,
                    progress: bool = False, served: EngineConfig | None = None) -> dict[str, Any]:
    """Every (mode, batch) cell ``cfg.repeats`` times, interleaved; the report's ``cells`` hold each repeat."""
    ids = prompts(tokenizer, max(cfg.batches), cfg.prompt_tokens)
    runs: dict[tuple[str, int], list[dict[str, float]]] = {}
    for rep in range(cfg.repeats):
        for mode in cfg.modes:
            for n in cfg.batches:
                load = os.getloadavg()[0]
                its, crossings = run_cell(target, draft, ids[:n], mode=mode, cfg=cfg, served=served)
                # the machine's 1-minute load average before and after the cell: other work on a shared
                # machine inflates forwards (threads waiting on each other) and Python alike
                runs.setdefault((mode, n), []).append({**summarize_cell(its), **crossings, "load_before": load,
                                                       "load_after": os.getloadavg()[0]})
                if progress:
                    s = runs[(mode, n)][-1]
                    print(f"[{rep + 1}/{cfg.repeats}] {mode:5s} n={n:3d}: non-forward {s['non_forward_share']:.1%} "
                          f"of {s['iteration_ms']:.1f} ms = {s['non_forward_ms']:.2f} ms (cpu time "
                          f"{s['non_forward_share_cpu']:.1%} = {s['non_forward_cpu_ms']:.2f} ms; "
                          f"vocabulary scans {s['vocab_scan_ms']:.2f} ms; load {s['load_before']:.1f})",
                          file=sys.stderr)
    return {"cells": cell_stats(runs)}


CROSSING_KEYS = (*(f"{k}_per_iteration" for k in KINDS), "blocking_per_iteration",
                 "ops_outside_forwards_per_iteration", "ops_inside_forwards_per_iteration")


def cell_stats(runs: dict[tuple[str, int], list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Per (mode, batch): the median and spread of the repeats' shares, and the repeats themselves."""
    cells = []
    for (mode, n), reps in sorted(runs.items(), key=lambda kv: (list(MODES).index(kv[0][0]), kv[0][1])):
        shares = [r["non_forward_share"] for r in reps]
        cells.append({
            "mode": mode, "policy": MODES[mode], "batch": n,
            "non_forward_share_median": statistics.median(shares),
            "non_forward_share_min": min(shares), "non_forward_share_max": max(shares),
            "non_forward_share_cpu_median": statistics.median(r["non_forward_share_cpu"] for r in reps),
            "iteration_ms_median": statistics.median(r["iteration_ms"] for r in reps),
            "non_forward_ms_median": statistics.median(r["non_forward_ms"] for r in reps),
            "non_forward_ms_min": min(r["non_forward_ms"] for r in reps),
            "non_forward_ms_max": max(r["non_forward_ms"] for r in reps),
            **({"vocab_scan_ms_median": statistics.median(r["vocab_scan_ms"] for r in reps),
                "non_forward_less_scans_ms_median": statistics.median(r["non_forward_less_scans_ms"] for r in reps),
                "non_forward_less_scans_ms_min": min(r["non_forward_less_scans_ms"] for r in reps),
                "non_forward_less_scans_ms_max": max(r["non_forward_less_scans_ms"] for r in reps)}
               if all("vocab_scan_ms" in r for r in reps) else {}),
            **({"non_forward_cpu_ms_median": statistics.median(r["non_forward_cpu_ms"] for r in reps),
                "non_forward_cpu_ms_min": min(r["non_forward_cpu_ms"] for r in reps),
                "non_forward_cpu_ms_max": max(r["non_forward_cpu_ms"] for r in reps)}
               if all("non_forward_cpu_ms" in r for r in reps) else {}),
            **({"cpu_ms_per_token_median": statistics.median(r["cpu_ms_per_token"] for r in reps),
                "cpu_ms_per_token_min": min(r["cpu_ms_per_token"] for r in reps),
                "cpu_ms_per_token_max": max(r["cpu_ms_per_token"] for r in reps),
                "tokens_per_iteration_median": statistics.median(r["tokens_per_iteration"] for r in reps)}
               if all("cpu_ms_per_token" in r for r in reps) else {}),
            **({"shapes": dict(sorted(sum((Counter(r["shapes"]) for r in reps), Counter()).items())),
                "predicted_iteration_ms_median": statistics.median(r["predicted_iteration_ms"] for r in reps),
                "predicted_plain_iteration_ms_median": statistics.median(r["predicted_plain_iteration_ms"]
                                                                         for r in reps)}
               if all("shapes" in r for r in reps) else {}),
            # counts hardly vary between repeats (the trees do); the median of each kind
            **{k: statistics.median(r[k] for r in reps) for k in CROSSING_KEYS if all(k in r for r in reps)},
            "repeats": reps,
        })
    return cells


def combine(reports: list[dict[str, Any]]) -> dict[str, Any]:
    """One report from runs of single cells (made one after another to interleave two code versions)."""
    runs: dict[tuple[str, int], list[dict[str, float]]] = {}
    for rep in reports:
        for c in rep["cells"]:
            runs.setdefault((c["mode"], c["batch"]), []).extend(c["repeats"])
    configs = [r["config"] for r in reports]
    shared = {k: v for k, v in configs[0].items() if all(c.get(k) == v for c in configs)}
    return {"config": shared, "cells": cell_stats(runs)}


def before_after(before: list[dict[str, Any]], after: list[dict[str, Any]]) -> dict[str, Any]:
    """The before/after table: per cell, both versions' median shares (wall and CPU time) and spreads."""
    b, a = combine(before), combine(after)
    after_cells = {(c["mode"], c["batch"]): c for c in a["cells"]}
    table = []
    for cb in b["cells"]:
        ca = after_cells.get((cb["mode"], cb["batch"]))
        if ca is None:
            continue
        row: dict[str, Any] = {"mode": cb["mode"], "batch": cb["batch"]}
        for label, c in (("before", cb), ("after", ca)):
            row[label] = {k: c[k] for k in ("non_forward_share_median", "non_forward_share_min",
                                            "non_forward_share_max", "non_forward_share_cpu_median",
                                            "iteration_ms_median", "non_forward_ms_median",
                                            "non_forward_cpu_ms_median", *CROSSING_KEYS)
                          if k in c}
            row[label]["repeats"] = len(c["repeats"])
        table.append(row)
    return {"table": table, "before": b, "after": a}


def source_version() -> str:
    """The commit of the code measured, ``+dirty`` with uncommitted changes ("unknown" outside git)."""
    root = Path(__file__).resolve().parents[2]
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--", "adaserve"],
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+dirty" if dirty else "")


def settings(target: ModelRunner, cfg: Any, *, model: str, device: str) -> dict[str, Any]:
    """Every setting that shaped the figures (``cfg``: the benchmark's own dataclass), for the report."""
    ecfg = EngineConfig()
    return {**asdict(cfg), "model": model, "device": device, "source": source_version(),
            "dtype": str(target.dtype).removeprefix("torch."),
            # the target's linears as loaded (``weights``: float, or its integer kinds and their kernels)
            "served_weights": served_description(target.model),
            "torch_threads": torch.get_num_threads(), "torch": torch.__version__, "cpus": os.cpu_count(),
            "host_cpu": host_cpu(), "allocator": allocator.in_use(), "d_max": ecfg.adaptive.d_max,
            "w_max": ecfg.adaptive.w_max,
            "budget_rule": ecfg.budget_rule, "attention": ecfg.attention,
            # what the target's CPU attention ran: SDPA, or the kernels' attend.c (CausalLM.attention_kernels)
            "attention_kernels": served_attention(target.model),
            # the CPU's kernels or the torch picks a GPU runs (``torch_picks``), as the timed iterations ran
            native_kernels.ENV: os.environ.get(native_kernels.ENV, "auto")}


def host_cpu() -> str:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor() or "unknown"
    return next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("model name")), "unknown")


def load_pair(model: str, device: str, kv_memory_mb: int, static_shapes: bool = False,
              weights: str = "float") -> tuple[ModelRunner, ModelRunner, Any]:
    """A model's pair as the benchmarks serve it: its target and draft runners (``weights``: quant.py's choices),
    each with a cache of ``kv_memory_mb``, and its tokenizer."""
    from adaserve.engine.build import resolve_device
    from adaserve.engine.loading.catalog import resolve
    from adaserve.engine.loading.loader import load_model, load_tokenizer

    pair = resolve(model, progress=False, weights=weights)
    if pair.draft is None:
        raise ValueError(f"{model} has no draft of its own")
    dev = resolve_device(device)
    rc = EngineConfig(kv=KVCacheConfig(memory_bytes=kv_memory_mb * 2**20), static_shapes=static_shapes)
    target = ModelRunner(load_model(pair.target, device=dev, progress=False, weights=weights), rc)
    draft = ModelRunner(load_model(pair.draft, device=dev, progress=False, weights=weights), rc)
    return target, draft, load_tokenizer(pair.target)


def run_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """Raises ValueError for bad settings (the CLI turns it into a one-line error)."""
    cfg = engine_only_config(args)
    set_threads(args.threads)
    target, draft, tok = load_pair(args.model, args.device, cfg.kv_memory_mb, cfg.static_shapes, weights=cfg.weights)
    config = {**settings(target, cfg, model=args.model, device=args.device), "sampling": "greedy, ignore_eos"}
    served = served_config(target, draft, args.model) if cfg.profiled else None
    if served is not None:  # the speculative cells' own budget and bounds, as served
        config |= {"budget": served.budget, "d_max": served.adaptive.d_max, "w_max": served.adaptive.w_max}
    report = {"benchmark": "engine-only", "config": config,
              **run_engine_only(target, draft, tok, cfg, progress=True, served=served)}
    # a GPU's captures that ran out of memory: those shapes ran eagerly, so its figures read slower than graphs'
    report["capture_failures"] = {"target": target.capture_failures, "draft": draft.capture_failures}
    write_report(report, args.json)
    return report


def set_threads(threads: int | None) -> None:
    if threads is not None:
        if threads < 1:
            raise ValueError("--threads must be >= 1")
        torch.set_num_threads(threads)


def write_report(report: dict[str, Any], path: Path | None) -> None:
    """JSON on stdout, and into ``path`` when given."""
    text = json.dumps(report, indent=2)
    if path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text + "\n")
    print(text)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m adaserve.bench.engine_only", description=__doc__.splitlines()[0])
    add_common(p)
    add_engine_only(p)
    p.add_argument("--before", nargs="+", type=Path, help="with --after: combine earlier reports into a "
                   "before/after table instead of measuring (scripts/engine-only-before-after.sh)")
    p.add_argument("--after", nargs="+", type=Path)
    args = p.parse_args(argv)
    if args.before or args.after:
        if not (args.before and args.after):
            p.error("--before and --after go together")
        load = [[json.loads(f.read_text()) for f in fs] for fs in (args.before, args.after)]
        write_report({"benchmark": "engine-only, before and after", **before_after(*load)}, args.json)
        return 0
    try:
        run_from_args(args)
    except ValueError as e:
        print(f"engine_only: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
