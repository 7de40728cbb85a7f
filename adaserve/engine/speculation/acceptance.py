"""What a drafted node is worth: its chance of acceptance, learnt from verification (docs/architecture.md §5).

Selection, the per-iteration budget and A(r) all read f(v), the probability that v is accepted. The
paper takes f from the draft: the product of the draft's conditional probabilities along v's path, an
accurate surrogate for a draft distilled to match the target. A draft that is not (ours are small) is
badly calibrated: on the tiny pair, verified trees' draft f summed to 1.17 tokens where 1.72 were
emitted (bonus included; docs/results/selection-trace-draft-f.json), so every decision that weighs a
token's worth against its cost undervalued trees.

Estimate instead, per node, P(accepted | parent accepted) by the node's rank among its siblings (rank 0:
the draft's favourite child), as Sequoia's positional acceptance vector does, and by how sure the draft was
of it (its conditional probability q(v), in ``q_bins`` equal bins): a cell (rank, bin) counts how often
such nodes were accepted. Learnt online from every verified tree, and blended with q(v) while data is scarce:

    p(v) = (hits[c] + w * q(v)) / (trials[c] + w),  c = (rank(v), bin(q(v)))     f(v) = prod of p along v's path

Why q's bin as well as the rank: one rate per rank pools confident and unsure nodes. On the demo pair a
rank-1 sibling was valued at 0.23-0.28 and accepted at 0.02-0.14 from depth 2 on, where its q is small,
and P(reaching depth 2) was valued at 0.82 and realised at 0.60 (issue 29's traces): trees verified more
tokens than a chain and accepted fewer. The draft's q, though miscalibrated, still orders nodes; the
bins keep that order and learn its scale.

A trial is a verified node whose parent was accepted; a hit, that it was accepted too. Counts decay so
the estimate follows the workload. Only selection reads f: verification never does, so outputs stay
exactly the target's, whatever f says (§7).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from adaserve.engine.model.tree import TokenTree


def sibling_ranks(tree: TokenTree) -> np.ndarray:
    """rank[i]: 0 for the child of its parent with the highest draft conditional probability, 1 for the
    next, ...; the root gets 0. Selection by f keeps a prefix of every sibling list in this order."""
    ranks = np.zeros(tree.size, np.int64)
    ranks[1:] = _Forest.of([tree]).sibling_ranks()
    return ranks


@dataclass(frozen=True)
class _Forest:
    """A batch of trees laid end to end: node j of tree i is node offsets[i] + j, and ``parents`` point within
    the forest (-1 at each root). One numpy pass then serves every tree of an iteration."""

    parents: np.ndarray  # [N]
    log_probs: np.ndarray  # [N]
    offsets: np.ndarray  # [n] each tree's first node
    tree_of: np.ndarray  # [N] which tree a node belongs to
    drafted: np.ndarray  # the non-root nodes, ascending

    @classmethod
    def of(cls, trees: Sequence[TokenTree]) -> _Forest:
        if len(trees) == 1:  # one tree (a lone request's iteration): its own arrays, every node but the root drafted
            t = trees[0]
            return cls(t.parents, t.log_probs, np.zeros(1, np.int64), np.zeros(t.size, np.int64),
                       np.arange(1, t.size))
        sizes = np.fromiter((t.size for t in trees), np.int64, len(trees))
        offsets = np.cumsum(sizes) - sizes
        tree_of = np.repeat(np.arange(len(trees)), sizes)
        parents = np.concatenate([t.parents for t in trees]) if trees else np.zeros(0, np.int64)
        parents = np.where(parents >= 0, parents + offsets[tree_of], -1)
        log_probs = np.concatenate([t.log_probs for t in trees]) if trees else np.zeros(0)
        return cls(parents, log_probs, offsets, tree_of, np.flatnonzero(parents >= 0))

    @property
    def size(self) -> int:
        return len(self.parents)

    def cond_log_probs(self) -> np.ndarray:
        """log q(v) = log f(v) - log f(parent) for every drafted node."""
        d = self.drafted
        return self.log_probs[d] - self.log_probs[self.parents[d]]

    def sibling_ranks(self) -> np.ndarray:
        """Every drafted node's rank among its siblings (sibling_ranks), in ``drafted`` order."""
        d = self.drafted
        par = self.parents[d]
        order = np.lexsort((d, -self.cond_log_probs(), par))  # group by parent, best child first
        sorted_par = par[order]
        ranks = np.empty(len(d), np.int64)
        if len(d) == 0:
            return ranks
        # each sorted node's group start: the last position at or before it where the parent changes (issue 30:
        # np.r_ and a repeat over the group lengths cost ~4x these three passes)
        at = np.arange(len(order))
        first = np.empty(len(order), bool)
        first[0] = True
        np.not_equal(sorted_par[1:], sorted_par[:-1], out=first[1:])
        ranks[order] = at - np.maximum.accumulate(np.where(first, at, 0))
        return ranks

    def path_sums(self, x: np.ndarray) -> np.ndarray:
        """s[v] = sum of x over v's path from its root (root included), by pointer jumping: jump[v] is an
        ancestor 2^k steps up after k passes; s[v] += s[jump[v]] doubles the reach, O(log depth) passes."""
        s = x.astype(np.float64, copy=True)
        jump = self.parents.copy()
        while True:
            live = (jump >= 0).nonzero()[0]
            if live.size == 0:
                return s
            s[live] = s[live] + s[jump[live]]
            jump[live] = jump[jump[live]]


@functools.cache
def _prefix(a: int) -> list[int]:
    """[0, 1, .., a]: a chain's accepted path that reaches depth a (compared, never modified)."""
    return list(range(a + 1))


# verified nodes of a sibling rank before its rate steers the tree's width
MIN_RANK_TRIALS = 16.0
# a rank's decayed trials below which its rate is no longer read (the counts have decayed to nothing: a
# rank unused for ~100k verified trees; its rate would be a ratio of denormals)
MIN_DECAYED_TRIALS = 1e-100


@dataclass
class RankAcceptance:
    max_rank: int = 8  # ranks past this share its counts
    q_bins: int = 8  # equal bins of the draft's conditional probability q(v) per rank; 1: the rank alone
    prior_weight: float = 4.0  # w: how many observations the draft's own probability is worth
    decay: float = 0.998  # per observed tree: counts halve over ~350 verified trees
    hits: np.ndarray = field(init=False)  # [max_rank + 1, q_bins]
    trials: np.ndarray = field(init=False)
    # trials per rank, never decayed: whether a rank has ever been tried enough for its rate to be read.
    # Decay scales a rank's hits and trials alike, so its rate stays what it was while no tree of that width
    # is drafted; gating on the decayed trials instead made a rate expire within a second of chains at a busy
    # batch, and the width fell back to Eq. 9's widest beam until it was learnt again (issue 29's wall clock)
    tried: np.ndarray = field(init=False)  # [max_rank + 1]

    def __post_init__(self) -> None:
        if self.max_rank < 0 or self.q_bins < 1:
            raise ValueError(f"RankAcceptance: need max_rank >= 0 and q_bins >= 1, got {self.max_rank}, {self.q_bins}")
        self.hits = np.zeros((self.max_rank + 1, self.q_bins))
        self.trials = np.zeros((self.max_rank + 1, self.q_bins))
        self.tried = np.zeros(self.max_rank + 1)

    def calibrate(self, tree: TokenTree) -> TokenTree:
        """The same tree with log f(v) = sum of log p along v's path (see the module docstring)."""
        return self.calibrate_many([tree])[0]

    def calibrate_many(self, trees: Sequence[TokenTree]) -> list[TokenTree]:
        """``calibrate`` for a whole batch in one pass over the trees laid end to end (_Forest); chains of one
        length (a width-1 beam search) as one ``[n, K]`` array (``_calibrate_chains``), to the same bits."""
        if len(trees) > 0 and trees[0].size > 1 and all(t.is_chain and t.size == trees[0].size for t in trees):
            return self._calibrate_chains(trees)
        if len(trees) == 1 and trees[0].size > 1 and (lone := self._calibrate_lone(trees[0])) is not None:
            return [lone]
        forest = _Forest.of(trees)
        if forest.drafted.size == 0:
            return list(trees)
        ranks, bins, q = self._cells(forest)
        p = (self.hits[ranks, bins] + self.prior_weight * q) / (self.trials[ranks, bins] + self.prior_weight)
        log_p = np.zeros(forest.size)
        log_p[forest.drafted] = np.log(np.minimum(np.maximum(p, 1e-9), 1.0 - 1e-9))  # np.clip's bits
        lf = forest.path_sums(log_p)  # log f(v) = log f(parent) + log p(v)
        below = np.ones(forest.size, bool)  # each tree's f decreases (selection): every node below its parent
        below[forest.drafted] = lf[forest.drafted] < lf[forest.parents[forest.drafted]]
        return [t if t.size <= 1 else TokenTree.trusted(t.tokens, t.parents, lf[o : o + t.size],
                                                        strict=bool(below[o : o + t.size].all()))
                for t, o in zip(trees, forest.offsets, strict=True)]

    def _lone_cells(self, tree: TokenTree) -> tuple[list[int], list[int], list[int], list[float]] | None:
        """``_cells`` of one tree's drafted nodes 1 .. M - 1 as Python lists, with the parents: (parents, ranks,
        bins, q). A lone request's tree has a handful of nodes, fewer than the forest pass's numpy calls (issue 30);
        q is numpy's exponential of the same differences, so every value has the forest pass's bits. None where a
        difference is NaN (the forest pass's sort order then decides the ranks)."""
        par = tree.parents.tolist()
        lp = tree.log_probs.tolist()
        cond = [lp[v] - lp[par[v]] for v in range(1, len(par))]  # log q(v), node v at cond[v - 1]
        if any(c != c for c in cond):
            return None
        kids: dict[int, list[int]] = {}
        for v in range(1, len(par)):
            kids.setdefault(par[v], []).append(v - 1)
        ranks = [0] * len(cond)
        for group in kids.values():  # best child first, ties to the lower index (sibling_ranks' lexsort)
            for r, i in enumerate(sorted(group, key=lambda i: (-cond[i], i))):
                ranks[i] = min(r, self.max_rank)
        q = np.exp(np.array(cond)).tolist()
        bins = [min(int(x * self.q_bins), self.q_bins - 1) for x in q]
        return par, ranks, bins, q

    def _calibrate_lone(self, tree: TokenTree) -> TokenTree | None:
        """``calibrate_many``'s forest pass for one tree of more than one node, in Python floats over its nodes: p,
        its clip, and the path sums in the forest's pointer-jumping order (``_Forest.path_sums``: each pass reads
        every node's sum before writing any), so the same bits. None: take the forest pass (``_lone_cells``)."""
        cells = self._lone_cells(tree)
        if cells is None:
            return None
        par, ranks, bins, q = cells
        hits, trials, w = self.hits.tolist(), self.trials.tolist(), self.prior_weight
        p = [(hits[r][b] + w * x) / (trials[r][b] + w) for r, b, x in zip(ranks, bins, q, strict=True)]
        log_p = np.log([min(max(x, 1e-9), 1.0 - 1e-9) for x in p]).tolist()  # np.clip's bits, numpy's log
        s, jump = [0.0, *log_p], list(par)
        while live := [v for v, j in enumerate(jump) if j >= 0]:
            add = [s[v] + s[jump[v]] for v in live]
            hop = [jump[jump[v]] for v in live]
            for v, a, h in zip(live, add, hop, strict=True):
                s[v], jump[v] = a, h
        strict = all(s[v] < s[par[v]] for v in range(1, len(s)))
        return TokenTree.trusted(tree.tokens, tree.parents, np.array(s), strict=strict)

    def _calibrate_chains(self, trees: Sequence[TokenTree]) -> list[TokenTree]:
        """``calibrate_many`` for chains of one length K > 1: every drafted node is its parent's only child (rank
        0) and node j's parent is node j - 1, so the forest's arrays are the ``[n, K]`` stack's columns. The
        path sums are ``_Forest.path_sums``' passes, s[j] += s[j - 2^k], in the same order: the same bits."""
        lp = np.stack([t.log_probs for t in trees])
        q = np.exp(lp[:, 1:] - lp[:, :-1])  # q(v) = f(v) / f(parent)
        bins = np.minimum((q * self.q_bins).astype(np.int64), self.q_bins - 1)
        p = (self.hits[0, bins] + self.prior_weight * q) / (self.trials[0, bins] + self.prior_weight)
        s = np.zeros(lp.shape)
        s[:, 1:] = np.log(np.clip(p, 1e-9, 1.0 - 1e-9))
        k = 1
        while k < s.shape[1]:  # pointer jumping on a chain: each pass adds the sum 2^k nodes up
            s[:, k:] = s[:, k:] + s[:, :-k]
            k *= 2
        strict = np.all(s[:, 1:] < s[:, :-1], axis=1).tolist()  # each chain's f decreases (selection)
        return [TokenTree.trusted(t.tokens, t.parents, s[i], depths=t.__dict__.get("_depths"), is_chain=True,
                                  strict=strict[i]) for i, t in enumerate(trees)]

    def observe(self, tree: TokenTree, accepted_nodes: list[int]) -> None:
        """Count one verified tree: every node whose parent was accepted is a trial."""
        self.observe_many([tree], [accepted_nodes])

    def observe_many(self, trees: Sequence[TokenTree], accepted: Sequence[Sequence[int]]) -> None:
        """``observe`` for a batch, in order: counts decay once per tree with drafted nodes, so a tree's counts
        carry decay ** (such trees after it in the batch), as one ``observe`` after another would give."""
        if self._observe_chains(trees, accepted):
            return
        if len(trees) == 1 and trees[0].size > 1 and self._observe_lone(trees[0], accepted[0]):
            return
        forest = _Forest.of(trees)
        if forest.drafted.size == 0:
            return
        on_path = np.zeros(forest.size, bool)
        # every tree's accepted nodes at once, in forest indices (one array, not one per tree)
        on_path[np.fromiter((v + o for nodes, o in zip(accepted, forest.offsets.tolist(), strict=True) for v in nodes),
                            np.int64)] = True
        drafted_tree = np.array([t.size > 1 for t in trees])
        later = drafted_tree[::-1].cumsum()[::-1] - drafted_tree  # trees with drafted nodes after each one
        self.hits *= self.decay ** int(drafted_tree.sum())
        self.trials *= self.decay ** int(drafted_tree.sum())
        ranks, bins, _ = self._cells(forest)
        tried = on_path[forest.parents[forest.drafted]]  # drafted nodes whose parent was accepted
        weight = (self.decay ** later[forest.tree_of[forest.drafted]])[tried]
        cells = (ranks[tried], bins[tried])
        self.tried += np.bincount(cells[0], minlength=self.max_rank + 1)
        np.add.at(self.trials, cells, weight)
        np.add.at(self.hits, cells, weight * on_path[forest.drafted][tried])

    def _observe_lone(self, tree: TokenTree, accepted: Sequence[int]) -> bool:
        """``observe_many``'s forest pass for one tree of more than one node (one decay; every trial weighs 1),
        counted node by node in the forest's order: the same sums, added in the same order, so the same bits.
        False (nothing counted) where ``_lone_cells`` declines."""
        cells = self._lone_cells(tree)
        if cells is None:
            return False
        par, ranks, bins, _ = cells
        on_path = [False] * len(par)
        for v in accepted:
            on_path[v] = True
        self.hits *= self.decay
        self.trials *= self.decay
        for v in range(1, len(par)):
            if on_path[par[v]]:  # a trial: its parent was accepted
                r, b = ranks[v - 1], bins[v - 1]
                self.tried[r] += 1
                self.trials[r, b] += 1.0
                self.hits[r, b] += 1.0 if on_path[v] else 0.0
        return True

    def _observe_chains(self, trees: Sequence[TokenTree], accepted: Sequence[Sequence[int]]) -> bool:
        """``observe_many`` for chains whose accepted nodes are a prefix 0..a (what verification accepts on a
        chain): node j was tried if j <= a + 1 and accepted if j <= a, all rank 0. The same counts, added in the
        same order, as the forest's pass; False (nothing counted) for any other batch."""
        idx: list[int] = []  # the tried nodes' forest indices, tree by tree
        a_of: list[int] = []  # per tried node: its tree's accepted depth a
        tree_of: list[int] = []
        at = drafted = 0
        for t, nodes in zip(trees, accepted, strict=True):
            a = len(nodes) - 1
            if not t.is_chain or a < 0 or a >= t.size or not isinstance(nodes, list) or nodes != _prefix(a):
                return False
            last = min(a + 1, t.size - 1)
            idx.extend(range(at + 1, at + last + 1))
            a_of.extend([at + a] * last)
            tree_of.extend([drafted] * last)
            drafted += t.size > 1
            at += t.size
        if drafted == 0:
            return True
        self.hits *= self.decay ** drafted
        self.trials *= self.decay ** drafted
        if not idx:
            return True
        lp = np.concatenate([t.log_probs for t in trees])
        nodes_at = np.asarray(idx, np.int64)
        q = np.exp(lp[nodes_at] - lp[nodes_at - 1])
        bins = np.minimum((q * self.q_bins).astype(np.int64), self.q_bins - 1)
        # decay ** (trees with drafted nodes after this one); only such trees have tried nodes
        weight = self.decay ** (drafted - 1 - np.asarray(tree_of, np.int64))
        cells = (np.zeros(len(idx), np.int64), bins)
        self.tried[0] += len(idx)
        np.add.at(self.trials, cells, weight)
        np.add.at(self.hits, cells, weight * (nodes_at <= np.asarray(a_of, np.int64)))
        return True

    def _cells(self, forest: _Forest) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(rank, q bin, q) of every drafted node of the forest, in ``forest.drafted`` order."""
        ranks = np.minimum(forest.sibling_ranks(), self.max_rank)
        q = np.exp(forest.cond_log_probs())
        bins = np.minimum((q * self.q_bins).astype(np.int64), self.q_bins - 1)
        return ranks, bins, q

    def rank_rates(self, ranks: int, min_trials: float = MIN_RANK_TRIALS) -> tuple[float, ...] | None:
        """P(a rank-r child is accepted | its parent was) for r < ``ranks``, over every q bin: what a beam of
        that many siblings is worth (adaptive.goodput_shape). None until every one of those ranks has been
        tried ``min_trials`` times (``tried``: counted once, never decayed): until then the tree keeps its
        width and learns. Once learnt a rate is kept while its rank goes untried (narrower trees); None again
        only if its decayed counts have run down to nothing (~350 verified trees per halving), so a width
        unused for that long is tried afresh."""
        if ranks < 1 or ranks > self.max_rank + 1:
            return None
        # the reductions' C forms, not the methods' Python layer (issue 30: read every iteration): the same sums
        hits, trials = np.add.reduce(self.hits[:ranks], axis=1), np.add.reduce(self.trials[:ranks], axis=1)
        if np.minimum.reduce(self.tried[:ranks]) < min_trials or np.minimum.reduce(trials) < MIN_DECAYED_TRIALS:
            return None
        return tuple((hits / trials).tolist())

    def rates(self) -> list[float | None]:
        """Observed acceptance by rank, over every q bin (None where nothing was tried), for reports."""
        hits, trials = self.hits.sum(axis=1), self.trials.sum(axis=1)
        return [float(h / t) if t > 0.5 else None for h, t in zip(hits, trials, strict=True)]
