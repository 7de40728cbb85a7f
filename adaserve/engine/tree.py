"""Token trees: the shape every speculation produces and every verification consumes.

A tree of M nodes is stored in topological order: node 0 is the root (the request's last accepted
token), and ``parents[i] < i`` for every other node. Prefill chunks and plain decoding are the
degenerate cases: a chain (``parents = [-1, 0, 1, ...]``) and a single root.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

# Smallest gap kept between a parent's and a child's log path probability, so that a greedy pick by
# path probability can never take a child before its parent (docs/architecture.md §5: ties orphan nodes).
STRICT_DECREASE_EPS = 1e-6


@dataclass(frozen=True)
class TokenTree:
    """A tree of draft tokens. ``log_probs[i]`` is log f(i): the draft's path probability of node i."""

    tokens: np.ndarray  # [M] int64
    parents: np.ndarray  # [M] int64, parents[0] == -1
    log_probs: np.ndarray  # [M] float64, log_probs[0] == 0.0

    def __post_init__(self) -> None:
        m = len(self.tokens)
        if m == 0:
            raise ValueError("a token tree needs at least its root")
        if len(self.parents) != m or len(self.log_probs) != m:
            raise ValueError("tokens, parents and log_probs must have the same length")
        if self.parents[0] != -1:
            raise ValueError("node 0 must be the root (parent -1)")
        idx = np.arange(m)
        if m > 1 and (np.any(self.parents[1:] < 0) or np.any(self.parents[1:] >= idx[1:])):
            raise ValueError("parents must satisfy 0 <= parents[i] < i: nodes in topological order")
        if np.any(np.isnan(self.log_probs)):
            raise ValueError("NaN path probability in token tree: the draft produced invalid log-probs")

    # ---- constructors -------------------------------------------------------------------------
    @staticmethod
    def root(token: int) -> TokenTree:
        return TokenTree(np.array([token], np.int64), np.array([-1], np.int64), np.zeros(1))

    @staticmethod
    def chain(tokens: Sequence[int]) -> TokenTree:
        m = len(tokens)
        return TokenTree(np.asarray(tokens, np.int64), np.arange(-1, m - 1, dtype=np.int64), np.zeros(m))

    @staticmethod
    def from_lists(tokens: Sequence[int], parents: Sequence[int],
                   log_probs: Sequence[float] | None = None) -> TokenTree:
        lp = np.zeros(len(tokens)) if log_probs is None else np.asarray(log_probs, np.float64)
        return TokenTree(np.asarray(tokens, np.int64), np.asarray(parents, np.int64), lp)

    # ---- derived structure --------------------------------------------------------------------
    @property
    def size(self) -> int:
        return len(self.tokens)

    def depths(self) -> np.ndarray:
        """depth[0] = 0, depth[i] = depth[parent[i]] + 1. Positions are ``prefix_len + depth``."""
        d = np.zeros(self.size, np.int64)
        for i in range(1, self.size):
            d[i] = d[self.parents[i]] + 1
        return d

    def ancestor_matrix(self) -> np.ndarray:
        """[M, M] bool: anc[i, j] is True when j is i or an ancestor of i (the tree attention mask)."""
        m = self.size
        anc = np.zeros((m, m), dtype=bool)
        for i in range(m):
            if i > 0:
                anc[i] = anc[self.parents[i]]
            anc[i, i] = True
        return anc

    def children(self) -> list[list[int]]:
        kids: list[list[int]] = [[] for _ in range(self.size)]
        for i in range(1, self.size):
            kids[self.parents[i]].append(i)
        return kids

    # ---- transformations ----------------------------------------------------------------------
    def subtree(self, selected: Sequence[int]) -> TokenTree:
        """The tree made of ``selected`` nodes (must include 0 and be closed under parents), reindexed."""
        keep = sorted(set(int(i) for i in selected))
        if not keep or keep[0] != 0:
            raise ValueError("a subtree must contain the root")
        new_index = {old: new for new, old in enumerate(keep)}
        parents = [-1]
        for old in keep[1:]:
            p = int(self.parents[old])
            if p not in new_index:
                raise ValueError(f"node {old} selected without its parent {p}: tree would be disconnected")
            parents.append(new_index[p])
        return TokenTree(self.tokens[keep], np.asarray(parents, np.int64), self.log_probs[keep])

    def with_strict_decrease(self, eps: float = STRICT_DECREASE_EPS) -> TokenTree:
        """Nudge ties so every child's path probability is strictly below its parent's."""
        lp = self.log_probs.copy()
        for i in range(1, self.size):
            lp[i] = min(lp[i], lp[self.parents[i]] - eps)
        return TokenTree(self.tokens, self.parents, lp)
