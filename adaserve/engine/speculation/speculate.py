"""Speculation: batched beam search on the draft model across all requests (docs/architecture.md §4).

Step 1 feeds every request's tokens the draft has not seen yet (accepted tokens of the last
iteration, ending with the root) and keeps the root's top-w children. Steps 2..d feed the w newest
beams of every request; each beam attends to its request's context and its own ancestors (tree
mask), and the top-w of the w*V extensions by cumulative log-probability form the next level.
Beam nodes' draft KV is scratch, dropped when speculation ends.

The levels never visit the host (issue 30): the beam state (tokens, parents, log path probabilities),
the top-k and the next level's inputs stay on the device. A level's layout needs no picks: positions,
slots and mask bounds depend only on the level and the widths, so every level, the catch-up of step 1 included
(on the torch backend), is planned at once before the first (``model/levels.py``: one host pass, one copy), the
picked ids feed the forward as they are, and
the ancestor rows grow on the device (a new node's row is its parent's plus itself). The whole candidate
tree comes to the host in one copy at the end. Where every fed level runs on a static bucket (a GPU's path), the
levels run as the draft's steps instead (``draft_steps.py``): each level's picks, growth and forward one function over
persistent buffers, one CUDA graph replay a level on a GPU, the same trees.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from adaserve.engine.model import native_kernels
from adaserve.engine.model.batch import Segment
from adaserve.engine.model.kv_cache import SequenceKV
from adaserve.engine.model.levels import BeamLevels
from adaserve.engine.model.runner import ForwardRecord, ModelRunner
from adaserve.engine.model.tree import STRICT_DECREASE_EPS, TokenTree
from adaserve.engine.speculation.beam_ops import (
    ancestor_rows,
    expand_on_device,
    grow_ancestors,
    host_ancestor_rows,
    kernel_takes,
)
from adaserve.engine.speculation.draft_steps import steps_for
from adaserve.engine.speculation.grammar import GrammarState

NOT_FINITE = "draft produced non-finite log-probs: refusing to build a tree"


@dataclass
class DraftInput:
    seq: SequenceKV  # the request's draft KV; ``seq.length`` tokens committed
    pending: list[int]  # tokens not yet in the draft KV; the last one is the root
    grammar: GrammarState | None = None  # structured output: the draft proposes only what the grammar allows


def beam_search(draft: ModelRunner, inputs: list[DraftInput], *, depth: int, width: int,
                expansion: tuple[int, ...] | None = None,
                on_forward: Callable[[ForwardRecord], None] | None = None) -> list[TokenTree]:
    """Candidate trees (root + ``depth`` levels of ``width`` nodes) with draft path log-probs.

    With ``expansion`` (SpecInfer's static trees) every node at depth i instead keeps its own top
    ``expansion[i]`` children, and ``depth = len(expansion)``.

    Every request's tree has the same number of nodes at every level (``width``, or the product of the
    expansions), so a level is one batched step over all requests: one log-softmax and one top-k over
    ``[n, F * V]`` (``[n, F, V]`` for static trees), on the device; the trees reach the host in one copy.

    ``on_forward`` is called right after each draft forward with what it computed (its ``ForwardRecord``):
    the first carries every request's catch-up tokens, the others ``n * width`` beam nodes, so a caller that
    reads its clock there times each forward with its own token and context counts (timing.ForwardSplitter).
    On a CPU (and on a simulated clock) a forward is done when it returns, so the split is exact; on a GPU
    the forwards are only queued then, and the one copy at the end waits for all of them, so the wait lands
    on the last forward's sample (the span stays exact).

    On a CPU whose kernels serve, every level is picked straight into the trees' host arrays (``SearchPicks``), its
    ancestor rows grown in the same call and a lone request's level masks made in host memory (``host_masks``):
    the same trees, with nothing to copy (docs/architecture.md, "The CPU's own path").

    Structured output (an input with a ``grammar``): each frontier row of such a request is masked by the grammar
    after that node's path before the level is expanded, so the draft proposes only tokens the grammar allows.
    The masks need the paths on the host: with any constrained request, each level's picks are copied there.
    """
    if expansion is not None:
        depth = len(expansion)
        if min(expansion, default=0) < 1:
            raise ValueError("every static expansion factor must be >= 1")
    if depth < 1 or width < 1:
        raise ValueError("beam search needs depth >= 1 and width >= 1")
    n = len(inputs)
    sizes = level_sizes(depth, width, expansion, draft.vocab_size)  # nodes per tree at each level, the root first
    committed = [x.seq.length + len(x.pending) for x in inputs]  # the pending tokens are real: they stay in the KV
    # the catch-up and levels 1 .. depth-1 are fed to the draft: their positions, slots and mask bounds planned
    # here, at once (the catch-up on the torch grid or a static bucket: elsewhere it is laid out like any
    # forward). The pending tokens are committed when the search ends, either way: a truncate before it would free
    # the pages the plan already gave the levels
    paths = _Paths(inputs) if any(x.grammar is not None for x in inputs) else None
    kernels = native_kernels.chosen() if draft.device.type == "cpu" else None  # once a search, not once a level
    # a CPU's own path, where its kernels serve: every level picked by them straight into the trees' host arrays,
    # growing the ancestor rows in the same call, and the levels' masks made in host memory by numpy (issue 30: a
    # level's torch tensors, the growth's and the masks' ops and the join at the end were most of a lone request's
    # search outside its forwards); a grammar's masks and a GPU take the device ops below
    per_node = [min(width if expansion is None else expansion[s], draft.vocab_size) for s in range(depth)]
    on_host = (kernels is not None and paths is None
               and all(kernel_takes(k, f) for k, f in zip(per_node, sizes, strict=False)))
    forwards = BeamLevels(draft, [x.seq for x in inputs], sizes[:depth], pending=[x.pending for x in inputs],
                          host_masks=on_host)
    dev = draft.device
    # on the device, per level: tokens, parents (tree index), log path probabilities, each [n, k]
    levels: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
    checks: list[tuple[torch.Tensor, torch.Tensor] | None] = []
    # every fed level on a static bucket (a GPU's path): the steps as functions over persistent buffers, each one a
    # CUDA graph there (draft_steps.py: the same picks, growth and forwards as the loop below)
    steps = None
    if not on_host and paths is None and draft.static is not None:
        steps = steps_for(forwards, depth=depth, width=width, expansion=expansion, sizes=sizes)
    # the levels' loop's own arrays, made here, before the first forward: none of them reads its logits (issue 30:
    # made after it, they ran cold, the forward's weights having passed through the caches)
    host = every = grown = anc = base = None
    if steps is None:
        chains = max(sizes) == 1  # every level one node (width 1): no level reads ancestor rows, none are grown
        # ancestor rows of every node the draft is fed, made once and filled level by level (None: chains); on the CPU's
        # own path of every node, the last level's too: the trees' ancestor matrices, handed to them as they stand
        side = sum(sizes) if on_host else forwards.tree_size
        # on the CPU's own path made by numpy and read by torch through ``from_numpy`` (issue 30: a torch ``clone`` and
        # ``numpy`` were two entry points of their own, cold after the last iteration's forwards); ``grown``: the same
        # rows, as numpy reads them
        grown = None if chains or not on_host else host_ancestor_rows(n, side, first_level=sizes[1])
        every = (None if chains else torch.from_numpy(grown) if grown is not None
                 else ancestor_rows(n, side, dev, first_level=sizes[1]))
        fed = forwards.tree_size
        # the fed nodes' rows (issue 30: on the CPU's own path numpy's slice of them, one view, not torch's three)
        anc = (every if every is None or side == fed
               else torch.from_numpy(grown[:, :fed, :fed]) if grown is not None else every[:, :fed, :fed])
        host = (native_kernels.SearchPicks(kernels, n, sum(sizes[1:]), every, sizes[1:])
                if on_host and kernels is not None else None)
        # the ops' frontier log path probabilities, on the device
        base = None if host is not None else torch.zeros((n, 1), dtype=torch.float64, device=dev)
    vocab = draft.vocab_size
    if forwards.folds_catch_up:
        rows = forwards.catch_up()  # [n, V]: each root's logits
    else:
        segs = [Segment(x.seq, x.seq.length, TokenTree.chain(x.pending)) for x in inputs]
        rows = draft.forward_joined(segs, all_logits=[False] * n)
    _seen(draft, on_forward)
    if rows.shape[-1] != vocab:
        raise ValueError(f"the draft's logits have {rows.shape[-1]} columns for a vocabulary of {vocab}")
    if steps is not None:
        for tok, parent, value, check in steps.run(forwards, rows, lambda: _seen(draft, on_forward)):
            levels.append((tok, parent, value))
            checks.append(check)
    else:
        frontier = 0  # tree index of the frontier's first node; the frontier is level ``step``, ``rows`` its logits
        for step in range(depth):
            if host is not None:  # level 1's rows (children of the root) were made with the rows
                tok = host.level(rows, k=per_node[step], width=None if expansion is not None else width,
                                 frontier=frontier, grow=every is not None and step > 0)
            else:
                k = None if expansion is None else expansion[step]
                allowed = None if paths is None else paths.allowed(frontier, sizes[step]).to(dev, non_blocking=True)
                assert base is not None
                tok, parent, value, check = expand_on_device(rows, base, width=width, per_node=k, allowed=allowed,
                                                              frontier=frontier, kernels=kernels)
                if paths is not None:
                    paths.add(tok, parent)
                levels.append((tok, parent, value))
                checks.append(check)
                base = value
            if step == depth - 1:
                break
            frontier += sizes[step]
            if host is None and anc is not None and step > 0:  # level 1's rows were made with the rows
                grow_ancestors(anc, frontier, parent)
            chain = max(sizes[: step + 2]) == 1  # one node per level so far: every tree is a chain, no rows needed
            rows = forwards.forward(step + 1, tok if host is not None else tok.reshape(-1), None if chain else anc)
            _seen(draft, on_forward)

    for x, c in zip(inputs, committed, strict=True):  # commit the pending tokens, drop the scratch beams
        draft.cache.truncate(x.seq, c)
    if host is None:
        toks, pars, lps = _to_host(levels, checks)
    elif not host.finite:
        raise FloatingPointError(NOT_FINITE)
    else:
        toks, pars, lps = host.tokens, host.parents, host.log_probs
    roots = np.asarray([x.pending[-1] for x in inputs], np.int64)[:, None]
    return build_trees(roots, toks, pars, lps, sizes[1:], ancestors=grown)


def level_sizes(depth: int, width: int, expansion: tuple[int, ...] | None, vocab: int) -> list[int]:
    """Nodes per candidate tree at each level, the root's 1 first: ``expand_on_device``'s pick counts, known
    before any pick (a level keeps the top ``width`` of its frontier's children; a static tree each node's top
    ``expansion[i]``; never more children per node than the vocabulary)."""
    sizes = [1]
    for step in range(depth):
        f = sizes[-1]
        if expansion is None:
            sizes.append(min(width, f * min(width, vocab)))
        else:
            sizes.append(f * min(expansion[step], vocab))
    return sizes


def build_trees(roots: np.ndarray, toks: np.ndarray, pars: np.ndarray, lps: np.ndarray,
                level_sizes: list[int], eps: float = STRICT_DECREASE_EPS,
                ancestors: np.ndarray | None = None) -> list[TokenTree]:
    """Every request's candidate tree from the search's [n, nodes] arrays (roots [n, 1]; parents as tree
    indices, the root being 0), with ``TokenTree.with_strict_decrease`` applied to all of them at once.
    ``ancestors``: the trees' [n, M, M] ancestor matrices where the search grew them already (the CPU kernels'
    picks); they are made read-only and shared by the trees, else made here (``_ancestor_matrices``).

    Every tree of one search has the same level sizes, so the nudge runs level by level over [n, level]
    columns, the depths are one shared array, and the trees need no per-tree checks: parents precede their
    children by construction and ``_to_host`` has refused non-finite log-probs.
    """
    n = roots.shape[0]
    if ancestors is not None:
        ancestors.flags.writeable = False
    if n == 1:
        return [_lone_tree(int(roots[0, 0]), toks[0], pars[0], lps[0], level_sizes, eps,
                           None if ancestors is None else ancestors[0])]
    toks = np.concatenate([roots, toks], axis=1)
    pars = np.concatenate([np.full((n, 1), -1, np.int64), pars], axis=1)
    lps = np.concatenate([np.zeros((n, 1)), lps], axis=1)
    rows = np.arange(n)[:, None]
    start = 1
    for size in level_sizes:  # parents are final before their children
        cols = slice(start, start + size)
        lps[:, cols] = np.minimum(lps[:, cols], lps[rows, pars[:, cols]] - eps)
        start += size
    depths = _depths(tuple(level_sizes))
    chain = all(size == 1 for size in level_sizes)
    strict = np.all(lps[:, 1:] < lps[rows, pars[:, 1:]], axis=1).tolist()  # each tree's f decreases (selection)
    anc = None if chain else ancestors if ancestors is not None else _ancestor_matrices(pars, level_sizes)
    return [TokenTree.trusted(toks[r], pars[r], lps[r], depths=depths, is_chain=chain, strict=strict[r],
                              ancestors=None if anc is None else anc[r]) for r in range(n)]


def _lone_tree(root: int, toks: np.ndarray, pars: np.ndarray, lps: np.ndarray, level_sizes: list[int],
               eps: float, ancestors: np.ndarray | None = None) -> TokenTree:
    """``build_trees`` for one request, its nudge and decrease check a pass over Python floats: a lone request's tree
    has a handful of nodes, fewer than the numpy calls of the batch's pass (issue 30). The same arrays, bit for bit:
    node i's value is min(f(i), f(parent) - eps), its parent's final first (parents precede their children)."""
    par = [-1, *pars.tolist()]
    lp = [0.0, *lps.tolist()]
    strict = True
    for i in range(1, len(lp)):
        above = lp[par[i]]
        lp[i] = min(lp[i], above - eps)
        strict = strict and lp[i] < above
    parents = np.array(par, np.int64)
    chain = all(size == 1 for size in level_sizes)
    return TokenTree.trusted(np.array([root, *toks.tolist()], np.int64), parents, np.array(lp),
                             depths=_depths(tuple(level_sizes)), is_chain=chain, strict=strict,
                             ancestors=None if chain else ancestors if ancestors is not None
                             else _ancestor_matrices(parents[None], level_sizes)[0])


@functools.lru_cache(maxsize=64)
def _depths(level_sizes: tuple[int, ...]) -> np.ndarray:
    """Every node's depth, the root's first, in a tree with ``level_sizes`` nodes at depths 1, 2, ...: one read-only
    array per shape, shared by every tree of it."""
    depths = np.repeat(np.arange(len(level_sizes) + 1), [1, *level_sizes])
    depths.flags.writeable = False
    return depths


def _ancestor_matrices(pars: np.ndarray, level_sizes: list[int]) -> np.ndarray:
    """[n, M, M] bool, read-only: every tree's ``ancestor_matrix`` at once from its parents [n, M] (the root's -1
    first), level by level over the shared level sizes: a node's row is its parent's row and itself. The
    verification's mask reads them (attention/masks.py), one tree at a time, level by level, otherwise."""
    n, m = pars.shape
    anc = np.zeros((n, m, m), bool)
    anc[:, np.arange(m), np.arange(m)] = True
    rows = np.arange(n)[:, None]
    start = 1
    for size in level_sizes:  # parents' rows are final before their children's
        anc[:, start : start + size] |= anc[rows, pars[:, start : start + size]]
        start += size
    anc.flags.writeable = False
    return anc


class _Paths:
    """The candidate trees' paths on the host, for the grammar masks of constrained requests' frontiers."""

    def __init__(self, inputs: list[DraftInput]) -> None:
        self.grammars = [x.grammar for x in inputs]
        self.paths: list[list[tuple[int, ...]]] = [[()] for _ in inputs]  # per request, per tree node

    def allowed(self, frontier: int, f: int) -> torch.Tensor:
        """bool [n, F, V]: each request's frontier nodes (tree indices ``frontier`` .. + F) under its grammar."""
        rows = []
        vocab = next(g.compiler.vocab_size for g in self.grammars if g is not None)
        for g, p in zip(self.grammars, self.paths, strict=True):
            rows.append(torch.ones(f, vocab, dtype=torch.bool) if g is None else g.allowed(p[frontier : frontier + f]))
        return torch.stack(rows)

    def add(self, tok: torch.Tensor, parent: torch.Tensor) -> None:
        """A level's picks (tokens, parents as tree indices), each [n, k]: one copy to the host."""
        both = torch.stack([tok, parent]).cpu().tolist()
        for p, toks, pars in zip(self.paths, both[0], both[1], strict=True):
            p += [(*p[a], t) for t, a in zip(toks, pars, strict=True)]


def _seen(draft: ModelRunner, on_forward: Callable[[ForwardRecord], None] | None) -> None:
    if on_forward is not None and draft.last_forward is not None:
        on_forward(draft.last_forward)


def _to_host(levels: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
             checks: list[tuple[torch.Tensor, torch.Tensor] | None]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every level's (tokens, parents, log path probabilities) in one copy, each [n, nodes]; raises when a
    level's logits were not all finite (``checks``: each level's least and greatest logit; None for a level whose picks
    checked its logits already, the CPU kernels')."""
    n = levels[0][0].shape[0]
    # [n, 3K], one float64 buffer from one cat (issue 30: four ops, not seventeen): the log path probabilities,
    # then the tokens, then the parents, promoted to float64 (the integers are exact: < 2**53)
    grid = torch.cat([v for _, _, v in levels] + [t for t, _, _ in levels] + [p for _, p, _ in levels], dim=1)
    k = grid.shape[1] // 3
    bounds = [x for pair in checks if pair is not None for x in pair]
    host = (torch.cat([grid.flatten(), torch.stack(bounds)]) if bounds else grid.flatten()).cpu().numpy()
    if bounds and not np.isfinite(host[3 * n * k :]).all():
        raise FloatingPointError(NOT_FINITE)
    both = host[: 3 * n * k].reshape(n, 3 * k)
    return both[:, k : 2 * k].astype(np.int64), both[:, 2 * k :].astype(np.int64), both[:, :k]


def expand_level(logits: list[torch.Tensor], base: np.ndarray | torch.Tensor, *, width: int,
                 per_node: int | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One beam level for every request at once.

    logits: per request [F, V], the draft's logits at its F frontier nodes (or all of them, [n * F, V],
    request-major); base [n, F]: their log path probabilities. score(f, v) = base[f] + log softmax(logits[f])[v],
    the log softmax in float32 (the logits' precision), the sums in float64.

    Beam: the top ``width`` of the F * V extensions. Only a node's own top-``width`` children can be among
    them (base[f] is one constant per node), and log softmax keeps a row's order, so each row's top-k of
    the raw logits, read in the row's log softmax, gives every candidate: the [n, F * V] scores are never
    built.
    Static (``per_node``): each frontier node's own top ``per_node``, node-major.
    The reductions run once over ``[n, F, V]``; the picks reach the host in one copy.
    Returns (tokens, frontier index of the parent, log path probability), each [n, k].
    """
    tok, parent, value, check = expand_on_device(logits, base, width=width, per_node=per_node,
                                                  kernels=native_kernels.chosen())
    return _to_host([(tok, parent, value)], [check])
