"""The draft's beam-search steps on static buckets, as functions over persistent buffers (issue 30: "graphs for what
repeats": the draft's steps with beam state, top-k, slots and the ancestor mask on the device).

``beam_search`` on the static path, with the torch picks a GPU runs, hands its levels here. Step s of a search of
depth d picks level s + 1 from level s's logits and, below the last level, feeds it to the draft:

    picks          tokens, parents, log path probabilities of level s + 1   (beam_ops.expand_on_device)
    ancestors      the new nodes' rows, each its parent's or'ed with its own (beam_ops.grow_ancestors)
    the bucket     the picks scattered into level s + 1's ids, its tree cells read from the ancestor rows
    the draft      the model over the bucket: level s + 1's logits, which step s + 1 reads

Each step is one function that reads and writes only buffers that outlive the search (this object's, the buckets',
the earlier steps' outputs). On a GPU the whole search, every step in turn (``search_function``), is captured once per
search shape as one CUDA graph and replayed: one launch a search, where the levels' loop launched a dozen picks ops and
half a dozen fills a level (SGLang's one graph for the multi-step draft). On a CPU the very same closures are called
step by step, search after search, each fed level's forward reported as it ends (the cost model's samples), and their
outputs copied into the first search's tensors, as a replay would leave them, so that every CPU test of the path holds
a step to reading nothing but its buffers (tests/engine/speculation/test_draft_steps.py; the search function itself is
held to the steps bit for bit there).

Per search, before the steps, the host queues two copies: the roots' logits into the root buffer, and every fed
level's integers, tree cells and their sources (``BeamLevels.static_levels``, staged as one array, the cells padded
to the bucket: a padded request's rows pick from rows that see the scratch page only) into the steps' input buffer;
a step copies its level's integers into the bucket itself (levels may share a bucket), and the first resets the
ancestor rows. The picks reach the host in one copy at the end, as on the eager path.

``ADASERVE_DRAFT_STEPS=off`` (read at each search) keeps the levels' loop (speculate.beam_search) instead: the switch
a GPU session flips if the graph misbehaves there, without a code change.

May import: numpy, torch, the model room, speculation.beam_ops.
"""

from __future__ import annotations

import os
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch

from adaserve.engine.model.levels import BeamLevels
from adaserve.engine.model.runner import ModelRunner
from adaserve.engine.model.static import StaticForward
from adaserve.engine.speculation.beam_ops import expand_on_device, grow_ancestors, initial_rows

# each draft's static forwards -> its searches' steps by shape (dropped with the runner's static path)
_STEPS: weakref.WeakKeyDictionary[StaticForward, dict[tuple, DraftSteps]] = weakref.WeakKeyDictionary()
ENV = "ADASERVE_DRAFT_STEPS"


def enabled() -> bool:
    """The draft's steps serve (the default), unless ``ADASERVE_DRAFT_STEPS`` says off."""
    return os.environ.get(ENV, "on").lower() not in ("off", "0", "false", "no")


@dataclass
class StepOut:
    """What step s leaves on the device: level s + 1's picks ([G, kept] each), its logits' least and greatest
    value over the batch bucket, and (below the last level) the draft's logits of level s + 1 ([G * Q, V])."""

    tok: torch.Tensor
    parent: torch.Tensor
    value: torch.Tensor
    lo: torch.Tensor
    hi: torch.Tensor
    logits: torch.Tensor | None

    def fields(self) -> tuple[torch.Tensor | None, ...]:
        return self.tok, self.parent, self.value, self.lo, self.hi, self.logits

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in self.fields() if t is not None]


def shapes_made(static: StaticForward) -> int:
    """How many search shapes have steps on this draft's static path (0: every search ran the levels' loop)."""
    return len(_STEPS.get(static, {}))


def steps_for(levels: BeamLevels, *, depth: int, width: int, expansion: tuple[int, ...] | None,
              sizes: list[int]) -> DraftSteps | None:
    """The steps of this search's shape (made at first use), or None where a level does not run on a static bucket
    or the steps are switched off (``ADASERVE_DRAFT_STEPS``)."""
    runner = levels.runner
    static = runner.static
    if static is None or not enabled():
        return None
    shape = levels.static_shape()
    if shape is None:
        return None
    key = (tuple(sizes), width, expansion, shape)
    by_shape = _STEPS.setdefault(static, {})
    steps = by_shape.get(key)
    if steps is None:
        steps = by_shape[key] = DraftSteps(runner, static, sizes=sizes, depth=depth, width=width,
                                           expansion=expansion, grids=shape)
    return steps


class DraftSteps:
    """One search shape's steps: G requests (the batch bucket), ``sizes`` nodes per tree at each level (the root
    first, ``depth + 1`` of them), each fed level's bucket ``grids[l - 1] = (G, Q, K)``."""

    def __init__(self, runner: ModelRunner, static: StaticForward, *, sizes: list[int], depth: int, width: int,
                 expansion: tuple[int, ...] | None, grids: tuple[tuple[int, int, int], ...]) -> None:
        self.runner, self.static = runner, static
        self.sizes, self.depth, self.width, self.expansion = list(sizes), depth, width, expansion
        self.grids = [static.grid(shape) for shape in grids]  # level l's bucket: grids[l - 1]
        g, dev = grids[0][0], runner.device
        self.g = g
        side = sum(sizes[:depth])  # the fed trees' nodes: the ancestor rows' side (BeamLevels.tree_size)
        self.chains = max(sizes) == 1
        # the roots' logits (step 0's input), their log path probabilities (0), the ancestor rows and their reset
        self.root = torch.zeros((g, runner.vocab_size), dtype=torch.float32, device=dev)
        self.base = torch.zeros((g, 1), dtype=torch.float64, device=dev)
        self.anc = None if self.chains else torch.zeros((g, side, side), dtype=torch.bool, device=dev)
        self.anc0 = None if self.chains else initial_rows(g, side, sizes[1], torch.device(dev))
        # every fed level's integers, tree cells and sources (BeamLevels.static_levels: one copy a search), and
        # where each level's sit in it
        self.inputs: torch.Tensor | None = None
        self.spans: list[list[slice]] = []
        # per fed level: its tokens' grid rows (b * Q + r, every request of the bucket), its bucket's forward
        self.at: list[torch.Tensor] = []
        self.forwards: list[Callable[[], torch.Tensor]] = []
        for level, grid in enumerate(self.grids, start=1):
            a = sizes[level]
            self.at.append((torch.arange(g, device=dev)[:, None] * grid.q + torch.arange(a, device=dev)).reshape(-1))
            # built once (the attention it holds reads the grid): what a graph captures, or on a CPU the same through
            # the module, timed and hooked as any forward
            self.forwards.append(static._function(grid) if static.graphs else static.eager_function(grid))
        self.fns: list[Callable[[], StepOut] | None] = [None] * depth  # a CPU's steps, made at first use
        self.outs: list[StepOut | None] = [None] * depth
        # a GPU's whole search as one graph, in a memory pool of its own: nothing it writes can land on the buffers
        # or outputs of the buckets' graphs, which share the model's pool
        self.graph: torch.cuda.CUDAGraph | None = None
        self.replayed = static.graphs  # a GPU: the search as that graph (``_replay``); a CPU: step by step

    # ---- one search --------------------------------------------------------------------------------------------
    def run(self, levels: BeamLevels, roots: torch.Tensor,
            on_forward: Callable[[], None]) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                            tuple[torch.Tensor, torch.Tensor]]]:
        """The search's levels from its roots' logits ``roots`` [n, V]: per level (tokens, parents, log path
        probabilities, (least, greatest logit)), each [n, kept] (views of the steps' outputs: read them before
        the next search). ``on_forward`` is called after each fed level, as the eager path reports its forwards (on a
        GPU after the one replay: the forwards are queued then, not done, as every GPU forward is when reported)."""
        n = roots.shape[0]
        self.root[:n].copy_(roots)
        block = levels.static_levels()  # every fed level's integers and tree cells with their sources
        if self.inputs is None:
            self.inputs = block.clone()
            self.spans = [levels.static_offsets(level) for level in range(1, self.depth)]
        elif block.shape != self.inputs.shape:  # a shape's arrays are one size: the steps' views were cut from it
            raise RuntimeError(f"draft steps: {tuple(block.shape)} staged for inputs of {tuple(self.inputs.shape)}")
        else:
            self.inputs.copy_(block)
        for grid in self.grids:  # the steps write (or clear) their buckets' tree buffers: the eager path clears next
            grid.has_cells = True
        t0 = time.perf_counter()
        if self.replayed and self._replay():
            for level in range(1, self.depth):  # queued, not done: reported as the eager path reports its forwards
                levels.report(level, t0)
                on_forward()
                t0 = time.perf_counter()
        else:
            self._steps(levels, on_forward)
        out = []
        for o in self.outs:
            assert o is not None
            out.append((o.tok[:n], o.parent[:n], o.value[:n], (o.lo, o.hi)))
        return out

    # ---- a GPU: the whole search, captured once and replayed ------------------------------------------------------
    def search_function(self) -> Callable[[], list[StepOut]]:
        """The whole search over buffers only: each step made from the outputs of the one before and called in turn.
        What a GPU captures as one graph; a CPU test calls it and holds it to the steps one by one."""

        def search() -> list[StepOut]:
            outs: list[StepOut] = []
            for s in range(self.depth):
                outs.append(self._make(s, outs[-1] if outs else None)())
            return outs

        return search

    def _replay(self) -> bool:
        """The search as its graph, captured the first time; False (nothing run) where the capture ran out of
        memory (``StaticForward.try_capture``): the steps then run one by one from here on, as on a CPU."""
        with torch.inference_mode():  # as the draft's forwards run: its outputs are inference tensors
            if self.graph is None:
                shape = f"draft search {[(g.g, g.q, g.k) for g in self.grids]} of depth {self.depth}"
                captured = self.static.try_capture(shape, self.search_function(), own_pool=True)
                if captured is None:  # the steps one by one from now on, their forwards through the module, timed
                    self.replayed = False
                    self.forwards = [self.static.eager_function(grid) for grid in self.grids]
                    return False
                self.graph, outs = captured
                self.outs = list(outs)
            with self.runner.model.timer.region(self.runner.device):
                self.graph.replay()
        return True

    # ---- a CPU: the steps made once, then called in turn ----------------------------------------------------------
    def _steps(self, levels: BeamLevels, on_forward: Callable[[], None]) -> None:
        """Every step in turn, each fed level's forward reported as it ends (a CPU's forwards are done when they
        return, so each sample is exact)."""
        for s in range(self.depth):
            t0 = time.perf_counter()
            self._step(s)
            if s < self.depth - 1:
                levels.report(s + 1, t0)
                on_forward()

    def _step(self, s: int) -> None:
        fn = self.fns[s]
        if fn is None:
            fn = self.fns[s] = self._make(s, self.outs[s - 1] if s else None)
        with torch.inference_mode():  # as the draft's forwards run: its outputs are inference tensors
            got = fn()
            out = self.outs[s]
            if out is None:  # tensors of their own (an output may be a view of a constant: one node's parents)
                self.outs[s] = StepOut(*(None if t is None else t.clone() for t in got.fields()))
            else:  # as a replay leaves them: the first call's tensors hold every later call's values
                for dst, src in zip(out.tensors(), got.tensors(), strict=True):
                    dst.copy_(src)

    # ---- a step's function -----------------------------------------------------------------------------------------
    def _make(self, s: int, prev: StepOut | None) -> Callable[[], StepOut]:
        """Step s's function, over buffers only: the roots' (s = 0) or step s - 1's outputs ``prev``, this object's,
        the buckets'."""
        sizes, g = self.sizes, self.g
        f = sizes[s]  # frontier nodes per tree
        frontier = sum(sizes[:s])  # tree index of the frontier's first node
        k = None if self.expansion is None else self.expansion[s]
        if s == 0:
            x, base = self.root, self.base
        else:
            assert prev is not None and prev.logits is not None
            q = self.grids[s - 1].q
            logits = prev.logits
            x = logits if q == f else logits.view(g, q, -1)[:, :f]  # each request's real rows
            base = prev.value
        fed = s < self.depth - 1
        start = frontier + f  # tree index of the new level's first node
        anc, anc0, inputs = self.anc, self.anc0, self.inputs
        assert inputs is not None
        grid = self.grids[s] if fed else None
        at = self.at[s] if fed else None
        forward = self.forwards[s] if fed else None
        # level s + 1's integers, and (a tree's level) its cells' places and sources: views of the inputs
        ints, *cells_src = [inputs[span] for span in self.spans[s]] if fed else [None]
        tree = fed and not self.chains and max(sizes[: s + 2]) > 1

        def step() -> StepOut:
            if s == 0 and anc is not None:  # the ancestor rows as a search begins (beam_ops.ancestor_rows)
                assert anc0 is not None
                anc.copy_(anc0)
            rows = x if x.dim() == 2 else x.reshape(g * f, -1)
            tok, parent, value, check = expand_on_device(rows, base, width=self.width, per_node=k,
                                                          frontier=frontier, kernels=None)
            assert check is not None
            if not fed:
                return StepOut(tok, parent, value, *check, None)
            assert grid is not None and at is not None and forward is not None
            if anc is not None and s > 0:  # level 1's rows were made with the reset (beam_ops.ancestor_rows)
                grow_ancestors(anc, start, parent)
            assert ints is not None
            grid.ints.copy_(ints)
            grid.ids.index_copy_(0, at, tok.reshape(-1))
            grid.tree.zero_()
            if tree:
                cells, src = cells_src
                assert anc is not None
                grid.tree.put_(cells, anc.take(src))
            return StepOut(tok, parent, value, *check, forward())

        return step
