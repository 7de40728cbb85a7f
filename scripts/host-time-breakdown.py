"""Where an iteration's host time goes, function by function (issue 30).

Decodes ``--requests`` requests with speculation (the microbench's ``spec`` mode: the adaserve policy, greedy,
one torch thread; ``--mode plain``: its ``plain`` mode, the incremental policy) and wraps each function below in a
timer that charges it its own wall time minus the time spent inside either model's forward while it ran.
Inclusive: a function's figure contains its callees' (the table is a tree, not a partition). Prints JSON: per
function, milliseconds and calls per iteration, with the iteration's total time outside the forwards and the tree
shapes drafted.

    PYTHONPATH=. python scripts/host-time-breakdown.py --requests 1 --iterations 1500 > out.json

Each wrapper costs ~1 us a call: the totals read a few percent above ``adaserve microbench``'s. A listed function
the engine does not have (an older commit's, run as ``PYTHONPATH=WORKTREE python scripts/host-time-breakdown.py`` for
a paired comparison) is left out and named in ``not_timed``.

``--kernels-ab``: one engine whose iterations run in blocks of ``--block`` that alternate ADASERVE_NATIVE_KERNELS
between ``off`` and ``on`` (the CPU kernels' beam picks and argmax, or the torch ops: read at each call), with a
table per setting: a paired comparison, both halves under the same load, on a machine whose speed drifts.

``--replayed-forwards``: is the host time what the forwards leave in the caches? The iterations run twice, on two
fresh engines: first with real forwards, each model's outputs recorded by their number of rows with their wall time;
then with every forward served from that recording (the latest output of the same model and rows, in turn), returned
after spinning for its recorded time, so the cost models see the same times and nothing a forward would read or
write passes through the caches between the host's stages. A table per run; ``replay_missed_forwards`` counts the
forwards of the second run whose shape was never recorded (they run for real). The outputs are not the ones their
inputs would give, so the trees differ: compare the functions' times per call, and the shapes drafted.

``--count-calls``: the same iterations under a profiling hook (``sys.setprofile``) that counts the calls made outside
the forwards: Python functions and C functions (numpy's and torch's entry points, builtins), in all and per listed
function, inclusive like the times (the wrappers' own calls are not counted). A measure of how much distinct work an
iteration does that the machine's speed and load do not move: the times are then slower (the hook's cost), the
counts are what to compare.

``--alone F[,F]``: after the run, each named function (pure ones: ``_to_host``, ``build_trees``) is called again
with its last arguments from the engine, ALONE_CALLS times in a row, and its warm time per call is reported beside
its in-engine one: how much of a stage's cost is the stage, and how much the code that ran between its calls.

``--shape D,W``: every speculative iteration drafts a tree D deep and W wide, whatever the policy chose (its
choice is still computed and timed). Without it the online cost models pick the shapes, so no two runs draft alike
(the share of 4-deep trees at one request ranged 31-46% across eight runs of one machine), and the shapes' mix moves
the iteration's host time as much as a change being measured: pin it for paired runs.

``--again F[,F]``: in the engine, each named pure function (AGAIN_PURE) is called a second time right after each
real call, with the same arguments, its result dropped; the first call's and the second's times are reported
(``again``), and the second's are left out of every other figure. The second call runs with what the first left in
the caches and the branch predictors: the gap between the two is what a stage pays for starting cold.

``--faults``: minor page faults per iteration, inside the forwards and outside them (``getrusage``, read around each
forward and each iteration: the reads add a few microseconds to the iteration's figure). Is the host's time memory
mapped afresh (an allocator giving pages back to the kernel, then touching them again)? Without TCMalloc glibc's
allocator maps a forward's larger buffers anew each time.
"""

from __future__ import annotations

import argparse
import collections
import importlib
import json
import os
import resource
import sys
import time
from typing import Any

import torch

from adaserve import allocator
from adaserve.bench.engine_only import host_cpu, load_pair, prompts, source_version
from adaserve.bench.microbench_options import MODES
from adaserve.engine.config import EngineConfig
from adaserve.engine.engine import Engine
from adaserve.engine.model import native_kernels
from adaserve.engine.model.layers import CausalLM
from adaserve.engine.request import Phase, Request
from adaserve.engine.speculation.policies import TreeShape
from adaserve.engine.speculation.sampling import SamplingParams

FUNCTIONS = [  # (module, qualified name)
    ("adaserve.engine.engine", "Engine.step"),
    ("adaserve.engine.engine", "Engine._speculate_and_select"),
    ("adaserve.engine.speculation.speculate", "beam_search"),
    ("adaserve.engine.speculation.speculate", "_expand_on_device"),  # before beam_ops.py (older commits)
    ("adaserve.engine.speculation.beam_ops", "expand_on_device"),
    ("adaserve.engine.speculation.speculate", "build_trees"),
    ("adaserve.engine.speculation.speculate", "_to_host"),
    ("adaserve.engine.model.native_kernels", "SearchPicks.level"),
    ("adaserve.engine.model.levels", "BeamLevels.__init__"),
    ("adaserve.engine.model.levels", "BeamLevels.catch_up"),
    ("adaserve.engine.model.levels", "BeamLevels.forward"),
    ("adaserve.engine.model.runner", "ModelRunner.forward"),
    ("adaserve.engine.model.static", "StaticForward.forward"),
    ("adaserve.engine.model.static", "StaticForward._fill"),
    ("adaserve.engine.model.levels", "BeamLevels.static_levels"),
    ("adaserve.engine.speculation.draft_steps", "DraftSteps.run"),
    ("adaserve.engine.model.batch", "build_layout"),
    ("adaserve.engine.model.attention.torch_sdpa", "TorchAttention.plan"),
    ("adaserve.engine.model.staging", "HostStage.send"),
    ("adaserve.engine.speculation.policies", "_Adaptive.tree_shape"),
    ("adaserve.engine.speculation.policies", "AdaServe.select"),
    ("adaserve.engine.engine", "Engine._calibrated"),
    ("adaserve.engine.speculation.acceptance", "RankAcceptance.observe_many"),
    ("adaserve.engine.speculation.verify", "draw_at_nodes"),
    ("adaserve.engine.speculation.verify", "walk_trees"),
    ("adaserve.engine.model.kv_cache", "PagedKVCache.move_many"),
    ("adaserve.engine.model.kv_cache", "PagedKVCache.truncate"),
    ("adaserve.engine.cost.timing", "OnlineCostModel.observe"),
    ("adaserve.engine.cost.timing", "OnlineCostModel._refit"),  # the least-squares refit, inside observe
    ("adaserve.engine.model.native_kernels", "chosen"),  # reads ADASERVE_NATIVE_KERNELS at each call
    ("adaserve.engine.engine", "Engine._emit"),
    # per request, or once a forward: what a batch's host time grows with
    ("adaserve.engine.model.tree", "TokenTree.root"),
    ("adaserve.engine.model.tree", "TokenTree.subtree"),
    ("adaserve.engine.speculation.adaptive", "recent_ratios"),
    ("adaserve.engine.speculation.verify", "walk"),
    ("adaserve.engine.speculation.verify", "commit_moves"),
    ("adaserve.engine.speculation.verify", "first_argmax"),
    ("adaserve.engine.model.runner", "joined_rows"),
    ("adaserve.engine.model.kv_cache", "PagedKVCache.ensure"),
    ("adaserve.engine.model.batch", "page_table"),
    ("adaserve.engine.model.attention.masks", "grid_mask"),
]


ALONE_CALLS = 2000
# --again: no state read or written but their outputs (``_expand_on_device``: its name before beam_ops.py)
AGAIN_PURE = ("_to_host", "build_trees", "_expand_on_device", "expand_on_device")


class Timers:
    def __init__(self) -> None:
        self.in_forwards = 0.0  # seconds inside either model's forward so far
        self.seconds: collections.Counter[str] = collections.Counter()
        self.calls: collections.Counter[str] = collections.Counter()
        self.on = False
        self.originals: dict[str, Any] = {}  # qualified name -> the unwrapped function
        self.last: dict[str, tuple[tuple, dict]] = {}  # qualified name -> its latest call's arguments
        self.absent: list[str] = []  # listed functions this version of the engine does not have
        self.active: list[str] = []  # the listed functions running now, outermost first (--count-calls)
        self.forwarding = False  # inside either model's forward
        self.counted: collections.Counter[str] = collections.Counter()  # calls outside forwards ("" = all)
        self.wrapper_code: Any = None  # the wrappers' own code object: their calls are not counted
        self.again: set[str] = set()  # --again: functions called a second time, timed apart
        self.again_seconds: collections.Counter[str] = collections.Counter()  # their second calls' seconds
        self.again_total = 0.0  # every second call's seconds: left out of the iteration's figure
        self.faults = False  # --faults: count minor page faults inside the forwards
        self.faults_in_forwards = 0

    def wrap(self, module: str, qualname: str) -> None:
        mod = importlib.import_module(module)
        owner_name, _, name = qualname.rpartition(".")
        owner = getattr(mod, owner_name, None) if owner_name else mod
        fn = getattr(owner, name, None)
        if fn is None:  # another version of the engine (a paired run against an older commit): not timed
            self.absent.append(qualname)
            return

        self.originals[qualname] = fn

        def timed(*args: Any, **kwargs: Any) -> Any:
            self.last[qualname] = (args, kwargs)
            self.active.append(qualname)
            t0, f0, a0 = time.perf_counter(), self.in_forwards, self.again_total
            try:
                return fn(*args, **kwargs)
            finally:
                if self.on:  # dict.get, not the Counter's Python __missing__: no call of its own to count
                    # neither the forwards nor a callee's second call (--again) is this function's time
                    spent = time.perf_counter() - t0 - (self.in_forwards - f0) - (self.again_total - a0)
                    self.seconds[qualname] = self.seconds.get(qualname, 0.0) + spent
                    self.calls[qualname] = self.calls.get(qualname, 0) + 1
                    if qualname in self.again:  # the same call once more, warm: timed apart, result dropped
                        t1 = time.perf_counter()
                        fn(*args, **kwargs)
                        warm = time.perf_counter() - t1
                        self.again_seconds[qualname] = self.again_seconds.get(qualname, 0.0) + warm
                        self.again_total += warm
                self.active.pop()

        self.wrapper_code = timed.__code__

        setattr(owner, name, timed)
        if not owner_name:  # a module-level function: rebind the names other modules imported
            for m in list(sys.modules.values()):
                if getattr(m, "__name__", "").startswith("adaserve") and getattr(m, name, None) is fn:
                    setattr(m, name, timed)

    def count(self, frame: Any, event: str, _arg: Any) -> None:
        """The profiling hook of ``--count-calls``: one more call outside the forwards, for every listed function
        running (and for all, under "")."""
        if self.on and not self.forwarding and event in ("call", "c_call") and frame.f_code is not self.wrapper_code:
            self.counted[""] += 1
            for q in self.active:
                self.counted[q] += 1

    def hook(self, model: torch.nn.Module) -> None:
        """Time ``model``'s forwards: a wrapper it calls as its ``forward``, not hooks (with hooks ``nn.Module`` takes a
        slower call path, most of whose work would land outside the span: engine_only.ForwardClock)."""
        forward = model.forward

        def timed(*args: Any, **kwargs: Any) -> Any:
            faults = minor_faults() if self.faults else 0
            start = time.perf_counter()
            self.forwarding = True
            try:
                return forward(*args, **kwargs)
            finally:
                self.in_forwards += time.perf_counter() - start
                self.forwarding = False
                if self.faults:
                    self.faults_in_forwards += minor_faults() - faults

        model.forward = timed  # type: ignore[method-assign]


def minor_faults() -> int:
    """This process's minor page faults so far (a page mapped on first touch, or mapped again after the allocator gave
    it back to the kernel): ``--faults``."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


class ReplayedForwards:
    """``--replayed-forwards`` (module docstring): ``CausalLM._logits`` recorded while ``mode`` is "record", served
    from the recording while it is "replay", called as it is otherwise."""

    def __init__(self) -> None:
        self.mode = "real"
        self.recorded: dict[tuple[int, int], list[tuple[torch.Tensor, float]]] = {}
        self.turn = 0
        self.missed = 0

    def install(self) -> None:
        real = CausalLM._logits

        def logits(model: CausalLM, input_ids: torch.Tensor, positions: torch.Tensor, backend: Any, cache: Any,
                   logits_rows: torch.Tensor | None) -> torch.Tensor:
            key = (id(model), int(logits_rows.shape[0] if logits_rows is not None else input_ids.shape[0]))
            if self.mode == "replay" and key in self.recorded:
                out, seconds = (got := self.recorded[key])[self.turn % len(got)]
                self.turn += 1
                end = time.perf_counter() + seconds
                while time.perf_counter() < end:  # the forward's time, touching nothing
                    pass
                return out
            self.missed += self.mode == "replay"
            t0 = time.perf_counter()
            out = real(model, input_ids, positions, backend, cache, logits_rows)
            if self.mode == "record":
                self.recorded.setdefault(key, []).append((out.clone(), time.perf_counter() - t0))
            return out

        CausalLM._logits = logits  # type: ignore[method-assign]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="demo-tiny")
    ap.add_argument("--requests", type=int, default=1)
    ap.add_argument("--mode", choices=("spec", "plain"), default="spec", help="the microbench's mode (docstring)")
    ap.add_argument("--iterations", type=int, default=1500)
    ap.add_argument("--max-tokens", type=int, default=1500, help="each request's cap; a batch restarts near it")
    ap.add_argument("--kernels-ab", action="store_true", help="alternate ADASERVE_NATIVE_KERNELS off / on by block")
    ap.add_argument("--block", type=int, default=25, help="iterations per block with --kernels-ab")
    ap.add_argument("--replayed-forwards", action="store_true",
                    help="a second run with every forward served from the first's recording (module docstring)")
    ap.add_argument("--count-calls", action="store_true",
                    help="count the calls outside the forwards, per function (module docstring)")
    ap.add_argument("--alone", default="", help="functions to time alone afterwards, comma-separated (docstring)")
    ap.add_argument("--shape", default="", help="D,W: draft every tree D deep and W wide (docstring)")
    ap.add_argument("--static-shapes", action="store_true",
                    help="both models on static buckets, the path a GPU replays as graphs, called eagerly here")
    ap.add_argument("--faults", action="store_true",
                    help="count minor page faults per iteration, inside and outside the forwards (docstring)")
    ap.add_argument("--again", default="", help="pure functions to call twice in the engine, comma-separated "
                                                f"(docstring): any of {', '.join(AGAIN_PURE)}")
    args = ap.parse_args()
    alone = [f for f in args.alone.split(",") if f]
    if unknown := [f for f in alone if f not in {q for _, q in FUNCTIONS}]:
        ap.error(f"--alone: not among the timed functions: {', '.join(unknown)}")
    shape = _pinned_shape(ap, args.shape)
    if shape is not None and args.mode == "plain":
        ap.error("--shape pins the trees drafted: --mode plain drafts none")
    again = [f for f in args.again.split(",") if f]
    if unknown := [f for f in again if f not in AGAIN_PURE]:
        ap.error(f"--again: not a pure timed function: {', '.join(unknown)} (choose from {', '.join(AGAIN_PURE)})")
    if again and (args.count_calls or args.kernels_ab or args.replayed_forwards):
        ap.error("--again times one engine's calls twice: run it without --count-calls, --kernels-ab or "
                 "--replayed-forwards")
    if args.kernels_ab and args.replayed_forwards:
        ap.error("--kernels-ab and --replayed-forwards are separate experiments: choose one")
    if args.faults and (args.count_calls or args.kernels_ab or args.replayed_forwards or again):
        ap.error("--faults counts one engine's iterations as they run: run it without --count-calls, --kernels-ab, "
                 "--replayed-forwards or --again")
    if args.count_calls and (args.kernels_ab or args.replayed_forwards):
        ap.error("--count-calls counts one engine's calls: run it without --kernels-ab or --replayed-forwards")
    replayed = ReplayedForwards()
    if args.replayed_forwards:
        replayed.install()
    torch.set_num_threads(1)
    timers = Timers()
    timers.again = set(again)
    timers.faults = args.faults
    for module, qualname in FUNCTIONS:
        timers.wrap(module, qualname)
    if missing := [f for f in alone + again if f in timers.absent]:
        ap.error(f"--alone/--again: this engine has no {', '.join(missing)}")
    target, draft, tok = load_pair(args.model, "cpu", 512, static_shapes=args.static_shapes)
    timers.hook(target.model)
    timers.hook(draft.model)
    ids = prompts(tok, args.requests, 128)

    def fresh() -> Engine:
        mode, replayed.mode = replayed.mode, "real"  # prefill and warm-up always on real forwards
        eng = Engine(target, draft, EngineConfig(policy=MODES[args.mode], max_batch=max(64, args.requests)))
        if shape is not None:
            pin_shape(eng.policy, shape)
        for i, p in enumerate(ids):
            eng.add_request(Request(f"r{i}", p, SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)))
        while eng.waiting or any(r.phase is not Phase.DECODE for r in eng.running):
            eng.step()
        for _ in range(5):
            eng.step()
        replayed.mode = mode
        return eng

    if args.kernels_ab:
        settings = ["off", "on"]
    elif args.replayed_forwards:
        settings = ["real", "replayed"]
    else:
        settings = [os.environ.get(native_kernels.ENV, "auto")]
    step_s = dict.fromkeys(settings, 0.0)
    counts = dict.fromkeys(settings, 0)
    seconds = {k: collections.Counter[str]() for k in settings}
    calls = {k: collections.Counter[str]() for k in settings}
    shapes = {k: collections.Counter[str]() for k in settings}
    faults_all, faults_inside = dict.fromkeys(settings, 0), dict.fromkeys(settings, 0)  # --faults
    replayed.mode = "record" if args.replayed_forwards else "real"
    eng = fresh()
    # --replayed-forwards: all the real iterations (recorded), then as many replayed ones on a fresh engine
    total = args.iterations * (2 if args.replayed_forwards else 1)
    for it in range(total):
        if args.replayed_forwards:
            setting = settings[it // args.iterations]
            if it == args.iterations:
                replayed.mode = "replay"
                eng = fresh()
        else:
            setting = settings[(it // args.block) % len(settings)]
        if args.kernels_ab:
            os.environ[native_kernels.ENV] = setting
        timers.seconds, timers.calls = seconds[setting], calls[setting]  # this iteration's table
        if eng.running[0].target_kv.length > args.max_tokens - 40:  # restart untimed before anyone finishes
            for r in list(eng.running):
                eng.abort(r.request_id)
            eng = fresh()
        f0, a0 = timers.in_forwards, timers.again_total
        timers.on = True
        if args.count_calls:
            sys.setprofile(timers.count)
        faults0, inside0 = (minor_faults(), timers.faults_in_forwards) if args.faults else (0, 0)
        t0 = time.perf_counter()
        eng.step()
        step_s[setting] += time.perf_counter() - t0 - (timers.in_forwards - f0) - (timers.again_total - a0)
        if args.faults:  # after the clock: the iteration's own reads are not charged to it
            faults_all[setting] += minor_faults() - faults0
            faults_inside[setting] += timers.faults_in_forwards - inside0
        sys.setprofile(None)
        timers.on = False
        m = eng.history[-1]
        shapes[setting][f"{m.depth},{m.width}"] += 1
        counts[setting] += 1

    def table(k: str) -> dict[str, Any]:
        n = counts[k]
        return {
            "iterations": n,
            "outside_forwards_ms_per_iteration": round(step_s[k] / n * 1e3, 3),
            "shapes_d_w": dict(shapes[k].most_common()),
            "functions": [{"function": f, "ms_per_iteration": round(v / n * 1e3, 3),
                           "calls_per_iteration": round(calls[k][f] / n, 2),
                           "us_per_call": round(v / calls[k][f] * 1e6, 1),
                           **({"calls_inside_per_iteration": round(timers.counted[f] / n, 1)} if args.count_calls
                              else {})} for f, v in seconds[k].most_common()],
            **({"calls_outside_forwards_per_iteration": round(timers.counted[""] / n, 1)} if args.count_calls
               else {}),
            **({"minor_faults_per_iteration": {"inside_forwards": round(faults_inside[k] / n, 2),
                                               "outside_forwards": round((faults_all[k] - faults_inside[k]) / n, 2)}}
               if args.faults else {}),
        }

    report: dict[str, Any] = {
        "benchmark": "host-time-breakdown", "source": source_version(), "cpu": host_cpu(),
        "allocator": allocator.in_use(), "model": args.model,
        "requests": args.requests, "iterations": args.iterations, "threads": 1,
        "mode": args.mode, "policy": MODES[args.mode],
        "pinned_shape": args.shape or None, "static_shapes": args.static_shapes,
        "not_timed": timers.absent,
    }
    if args.replayed_forwards:
        report |= {"replayed_forwards": {k: table(k) for k in settings}, "replay_missed_forwards": replayed.missed,
                   "replayed_over_real": round(step_s["replayed"] / counts["replayed"]
                                               / (step_s["real"] / counts["real"]), 3)}
    elif args.kernels_ab:
        report |= {"kernels_ab": {"block": args.block, **{k: table(k) for k in settings}},
                   "on_over_off": round(step_s["on"] / counts["on"] / (step_s["off"] / counts["off"]), 3)}
    else:
        report |= {native_kernels.ENV: settings[0], **table(settings[0])}
    def per_call_us(f: str, total_s: float) -> float:
        """``total_s`` over every setting's calls of ``f``, in microseconds a call."""
        return round(total_s / sum(c[f] for c in calls.values()) * 1e6, 1)

    if again:  # per call: the real (first) call against the same call made again right after it
        report["again"] = {f: {"us_per_call_first": per_call_us(f, sum(t[f] for t in seconds.values())),
                               "us_per_call_again": per_call_us(f, timers.again_seconds[f])} for f in again}
    if alone:
        report["alone"] = {f: {"us_per_call_alone": time_alone(timers, f),
                               "us_per_call_in_engine": per_call_us(f, sum(t[f] for t in seconds.values()))}
                           for f in alone}
    print(json.dumps(report, indent=2))


def pin_shape(policy: Any, shape: TreeShape) -> None:
    """``--shape``: ``policy``'s trees are ``shape``. Its own ``tree_shape`` (the class's method, timed) still runs
    every iteration and its choice is dropped. Read from the class, not the instance, so pinning a policy twice (a
    restarted engine over the same policy object) does not wrap the earlier pin."""
    chosen = type(policy).tree_shape.__get__(policy)

    def pinned(view: Any) -> TreeShape:
        chosen(view)
        return shape

    object.__setattr__(policy, "tree_shape", pinned)  # policies are frozen dataclasses: this run's own setting


def _pinned_shape(ap: argparse.ArgumentParser, text: str) -> TreeShape | None:
    """``--shape D,W`` as a TreeShape (None when not given); a CLI error for anything but two integers >= 1."""
    if not text:
        return None
    try:
        depth, width = (int(x) for x in text.split(","))
    except ValueError:
        ap.error(f"--shape: expected D,W (two integers), got {text!r}")
    if depth < 1 or width < 1:
        ap.error(f"--shape: depth and width must be >= 1, got {text!r}")
    return TreeShape(depth, width)


def time_alone(timers: Timers, qualname: str) -> float:
    """Microseconds per call of ``qualname`` called ALONE_CALLS times in a row with its latest in-engine arguments."""
    fn, (args, kwargs) = timers.originals[qualname], timers.last[qualname]
    for _ in range(ALONE_CALLS // 10):  # warm
        fn(*args, **kwargs)
    t0 = time.perf_counter()
    for _ in range(ALONE_CALLS):
        fn(*args, **kwargs)
    return round((time.perf_counter() - t0) / ALONE_CALLS * 1e6, 1)


if __name__ == "__main__":
    main()
