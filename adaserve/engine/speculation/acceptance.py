"""What a drafted node is worth: its chance of acceptance, learnt from verification (docs/architecture.md §5).

Selection, the per-iteration budget and A(r) all read f(v), the probability that v is accepted. The
paper takes f from the draft: the product of the draft's conditional probabilities along v's path, an
accurate surrogate for a draft distilled to match the target. A draft that is not (ours are small) is
badly calibrated: on the tiny pair, verified trees' draft f summed to 1.17 tokens where 1.72 were
emitted (bonus included; docs/results/selection-trace-draft-f.json), so every decision that weighs a
token's worth against its cost undervalued trees.

Estimate instead, per node, P(accepted | parent accepted) by the node's rank among its siblings (rank 0:
the draft's favourite child), as Sequoia's positional acceptance vector does, learnt online from every
verified tree, and blended with the draft's own conditional probability q(v) while data is scarce:

    p(v) = (hits[rank(v)] + w * q(v)) / (trials[rank(v)] + w)            f(v) = prod of p along v's path

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
    prior_weight: float = 4.0  # w: how many observations the draft's own probability is worth
    decay: float = 0.998  # per observed tree: counts halve over ~350 verified trees
    hits: np.ndarray = field(init=False)
    trials: np.ndarray = field(init=False)

    def __post_init__(self) -> None:
        self.hits = np.zeros(self.max_rank + 1)
        self.trials = np.zeros(self.max_rank + 1)

    def calibrate(self, tree: TokenTree) -> TokenTree:
        """The same tree with log f(v) = sum of log p along v's path (see the module docstring)."""
        if tree.size <= 1:
            return tree
        ranks = np.minimum(sibling_ranks(tree), self.max_rank)
        q = np.exp(tree.log_probs[1:] - tree.log_probs[tree.parents[1:]])
        p = (self.hits[ranks[1:]] + self.prior_weight * q) / (self.trials[ranks[1:]] + self.prior_weight)
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
        ranks = np.minimum(sibling_ranks(tree), self.max_rank)
        tried = np.flatnonzero(on_path[tree.parents[1:]]) + 1
        np.add.at(self.trials, ranks[tried], 1.0)
        np.add.at(self.hits, ranks[tried], on_path[tried].astype(float))

    def rates(self) -> list[float | None]:
        """Observed acceptance by rank (None where nothing was tried), for reports."""
        return [float(h / t) if t > 0.5 else None for h, t in zip(self.hits, self.trials, strict=True)]
