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

from dataclasses import dataclass, field

import numpy as np

from adaserve.engine.model.tree import TokenTree


def sibling_ranks(tree: TokenTree) -> np.ndarray:
    """rank[i]: 0 for the child of its parent with the highest draft conditional probability, 1 for the
    next, ...; the root gets 0. Selection by f keeps a prefix of every sibling list in this order."""
    m = tree.size
    ranks = np.zeros(m, np.int64)
    if m <= 1:
        return ranks
    nodes = np.arange(1, m)
    par = tree.parents[1:]
    cond = tree.log_probs[1:] - tree.log_probs[par]
    order = np.lexsort((nodes, -cond, par))  # group by parent, best child first
    sorted_par = par[order]
    starts = np.r_[0, np.flatnonzero(np.diff(sorted_par)) + 1]
    group_start = np.repeat(starts, np.diff(np.r_[starts, len(order)]))
    ranks[nodes[order]] = np.arange(len(order)) - group_start
    return ranks


@dataclass
class RankAcceptance:
    max_rank: int = 8  # ranks past this share its counts
    q_bins: int = 8  # equal bins of the draft's conditional probability q(v) per rank; 1: the rank alone
    prior_weight: float = 4.0  # w: how many observations the draft's own probability is worth
    decay: float = 0.998  # per observed tree: counts halve over ~350 verified trees
    hits: np.ndarray = field(init=False)  # [max_rank + 1, q_bins]
    trials: np.ndarray = field(init=False)

    def __post_init__(self) -> None:
        if self.max_rank < 0 or self.q_bins < 1:
            raise ValueError(f"RankAcceptance: need max_rank >= 0 and q_bins >= 1, got {self.max_rank}, {self.q_bins}")
        self.hits = np.zeros((self.max_rank + 1, self.q_bins))
        self.trials = np.zeros((self.max_rank + 1, self.q_bins))

    def _cells(self, tree: TokenTree) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(rank, q bin, q) of every drafted node (nodes 1..m-1)."""
        ranks = np.minimum(sibling_ranks(tree)[1:], self.max_rank)
        q = np.exp(tree.log_probs[1:] - tree.log_probs[tree.parents[1:]])
        bins = np.minimum((q * self.q_bins).astype(np.int64), self.q_bins - 1)
        return ranks, bins, q

    def calibrate(self, tree: TokenTree) -> TokenTree:
        """The same tree with log f(v) = sum of log p along v's path (see the module docstring)."""
        if tree.size <= 1:
            return tree
        ranks, bins, q = self._cells(tree)
        p = (self.hits[ranks, bins] + self.prior_weight * q) / (self.trials[ranks, bins] + self.prior_weight)
        log_p = np.log(np.clip(p, 1e-9, 1.0 - 1e-9))
        lp = np.zeros(tree.size)
        depth = tree.depths()
        for level in range(1, int(depth.max()) + 1):  # parents first: log f(v) = log f(parent) + log p(v)
            nodes = np.flatnonzero(depth == level)
            lp[nodes] = lp[tree.parents[nodes]] + log_p[nodes - 1]
        return TokenTree(tree.tokens, tree.parents, lp)

    def observe(self, tree: TokenTree, accepted_nodes: list[int]) -> None:
        """Count one verified tree: every node whose parent was accepted is a trial."""
        if tree.size <= 1:
            return
        self.hits *= self.decay
        self.trials *= self.decay
        on_path = np.zeros(tree.size, bool)
        on_path[accepted_nodes] = True
        ranks, bins, _ = self._cells(tree)
        tried = np.flatnonzero(on_path[tree.parents[1:]])  # drafted nodes (index - 1) whose parent was accepted
        np.add.at(self.trials, (ranks[tried], bins[tried]), 1.0)
        np.add.at(self.hits, (ranks[tried], bins[tried]), on_path[tried + 1].astype(float))

    def rates(self) -> list[float | None]:
        """Observed acceptance by rank, over every q bin (None where nothing was tried), for reports."""
        hits, trials = self.hits.sum(axis=1), self.trials.sum(axis=1)
        return [float(h / t) if t > 0.5 else None for h, t in zip(hits, trials, strict=True)]
