"""Token trees: the shape every speculation produces and every verification consumes.

A tree of M nodes is stored in topological order: node 0 is the root (the request's last accepted
token), and ``parents[i] < i`` for every other node. Prefill chunks and plain decoding are the
degenerate cases: a chain (``parents = [-1, 0, 1, ...]``) and a single root.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import numpy as np

# Smallest gap kept between a parent's and a child's log path probability, so that a greedy pick by
# path probability can never take a child before its parent (docs/architecture.md §5: ties orphan nodes).
STRICT_DECREASE_EPS = 1e-6

@functools.cache
def _first(k: int) -> list[int]:
    """[0, 1, .., k - 1], compared with a selection in one list comparison (never modified)."""
    return list(range(k))


_ROOT_PARENTS = np.array([-1], np.int64)
_ROOT_PARENTS.flags.writeable = False
_ROOT_DEPTHS = np.zeros(1, np.int64)
_ROOT_DEPTHS.flags.writeable = False
_ROOT_LOG_PROBS = np.zeros(1)  # log f(root) = 0
_ROOT_LOG_PROBS.flags.writeable = False


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
    @classmethod
    def trusted(cls, tokens: np.ndarray, parents: np.ndarray, log_probs: np.ndarray, *,
                depths: np.ndarray | None = None, is_chain: bool | None = None,
                strict: bool | None = None, ancestors: np.ndarray | None = None) -> TokenTree:
        """A tree from arrays whose invariants hold by construction (a subtree of a valid tree, a builder
        that appends children after their parents): the checks of ``__post_init__`` are skipped, which
        matters where thousands of trees are built per second (the replay clock, bench/sim/replay.py, and
        every iteration's candidate, selected and root trees, issue 30).

        ``depths`` / ``is_chain`` / ``strict`` / ``ancestors``: what the builder already knows (a subtree keeps its
        nodes' depths, every beam tree of one search has the same level sizes, a batch checked its trees' decrease
        and built their ancestor matrices at once); they seed the caches that ``depths()``, ``is_chain``,
        ``strictly_decreasing`` and ``ancestor_matrix()`` would otherwise compute. ``depths`` and ``ancestors``
        must be read-only."""
        tree = object.__new__(cls)
        object.__setattr__(tree, "tokens", tokens)
        object.__setattr__(tree, "parents", parents)
        object.__setattr__(tree, "log_probs", log_probs)
        # cached_property keeps its value in the instance dict: seeding it there is what a first read stores
        if depths is not None:
            tree.__dict__["_depths"] = depths
        if is_chain is not None:
            tree.__dict__["_is_chain"] = is_chain
        if strict is not None:
            tree.__dict__["_strict"] = strict
        if ancestors is not None:
            tree.__dict__["_ancestors"] = ancestors
        return tree

    @staticmethod
    def root(token: int) -> TokenTree:
        return TokenTree.trusted(np.array([token], np.int64), _ROOT_PARENTS, _ROOT_LOG_PROBS, depths=_ROOT_DEPTHS,
                                 is_chain=True)

    @staticmethod
    def roots(tokens: Sequence[int]) -> list[TokenTree]:
        """``root`` of each of ``tokens``: a plain iteration's trees, one a request, their tokens rows of one array
        (issue 30: an array, a zero and a tree each, 32 times an iteration, were ~5% of plain decoding's host time
        outside the forward at 32 requests)."""
        rows = np.array(tokens, np.int64).reshape(-1, 1)
        # ``trusted``'s fields and seeded caches, each tree's set in one call (a frozen dataclass's fields live in
        # its instance dict, as ``trusted`` stores them)
        shared = {"parents": _ROOT_PARENTS, "log_probs": _ROOT_LOG_PROBS, "_depths": _ROOT_DEPTHS, "_is_chain": True}
        trees = []
        for row in rows:
            tree = object.__new__(TokenTree)
            tree.__dict__.update(shared, tokens=row)
            trees.append(tree)
        return trees

    @staticmethod
    def chain(tokens: Sequence[int]) -> TokenTree:
        m = len(tokens)
        if m == 0:
            raise ValueError("a token tree needs at least its root")
        depths = np.arange(m, dtype=np.int64)
        depths.flags.writeable = False
        return TokenTree.trusted(np.asarray(tokens, np.int64), np.arange(-1, m - 1, dtype=np.int64), np.zeros(m),
                                 depths=depths, is_chain=True)

    @staticmethod
    def from_lists(tokens: Sequence[int], parents: Sequence[int],
                   log_probs: Sequence[float] | None = None) -> TokenTree:
        lp = np.zeros(len(tokens)) if log_probs is None else np.asarray(log_probs, np.float64)
        return TokenTree(np.asarray(tokens, np.int64), np.asarray(parents, np.int64), lp)

    # ---- derived structure --------------------------------------------------------------------
    @property
    def size(self) -> int:
        return len(self.tokens)

    @property
    def is_chain(self) -> bool:
        """parents == [-1, 0, 1, ...]: a prefill chunk or a lone root."""
        return self._is_chain

    @cached_property
    def _is_chain(self) -> bool:
        return bool(np.array_equal(self.parents, np.arange(-1, self.size - 1)))

    @property
    def strictly_decreasing(self) -> bool:
        """f(child) < f(parent) at every node: what greedy selection by f needs to keep trees connected
        (selection.strict_log_probs nudges a tree where it does not hold)."""
        return self._strict

    @cached_property
    def _strict(self) -> bool:
        lp = self.log_probs
        return self.size <= 1 or bool(np.all(lp[1:] < lp[self.parents[1:]]))

    @property
    def depth(self) -> int:
        """The deepest level (0 for a lone root): a chain's is its size less one, no reduction over its depths."""
        # the ufunc's reduce, not ``ndarray.max`` (whose Python layer, numpy's ``_methods``, ran cold once a tree an
        # iteration: issue 30)
        return self.size - 1 if self.is_chain else int(np.maximum.reduce(self._depths))

    def depths(self) -> np.ndarray:
        """depth[0] = 0, depth[i] = depth[parent[i]] + 1. Positions are ``prefix_len + depth``. Read-only."""
        return self._depths

    @cached_property
    def _depths(self) -> np.ndarray:
        if self.is_chain:
            d = np.arange(self.size, dtype=np.int64)
        else:
            # pointer jumping: jump[i] is an ancestor dist[i] steps up (the root jumps to itself, 0 steps);
            # dist[i] += dist[jump[i]], jump[i] = jump[jump[i]] doubles the reach: O(log depth) passes
            jump = np.maximum(self.parents, 0)
            d = (np.arange(self.size) > 0).astype(np.int64)
            while jump.any():
                d = d + d[jump]
                jump = jump[jump]
        d.flags.writeable = False
        return d

    def ancestor_matrix(self) -> np.ndarray:
        """[M, M] bool: anc[i, j] is True when j is i or an ancestor of i (the tree attention mask). Read-only."""
        return self._ancestors

    @cached_property
    def _ancestors(self) -> np.ndarray:
        m = self.size
        if self.is_chain:
            anc = np.tri(m, dtype=bool)
        else:
            # level by level: anc[i] = anc[parent[i]] OR onehot(i), every node of one depth at once
            anc = np.eye(m, dtype=bool)
            depth = self.depths()
            for level in range(1, int(depth.max()) + 1):
                nodes = np.flatnonzero(depth == level)
                anc[nodes] |= anc[self.parents[nodes]]
        anc.flags.writeable = False
        return anc

    def children(self) -> list[list[int]]:
        kids: list[list[int]] = [[] for _ in range(self.size)]
        for i in range(1, self.size):
            kids[self.parents[i]].append(i)
        return kids

    # ---- transformations ----------------------------------------------------------------------
    def subtree(self, selected: Sequence[int]) -> TokenTree:
        """The tree made of ``selected`` nodes (must include 0 and be closed under parents), reindexed. Every node,
        in order (a selection that keeps the whole candidate, as a small batch's often does): the tree itself."""
        m = self.size
        if isinstance(selected, list) and 0 < len(selected) <= m and selected == _first(len(selected)):
            # nodes 0 .. k - 1 (parents come first, so a prefix is closed under parents): every node keeps its
            # index, so the arrays are the first k of each, with no reindexing (issue 30: a chain's accepted
            # prefix, or the whole tree, which is the tree itself)
            k = len(selected)
            if k == m:
                return self
            anc = self.__dict__.get("_ancestors")
            depths = self.depths()[:k]
            return TokenTree.trusted(self.tokens[:k], self.parents[:k], self.log_probs[:k], depths=depths,
                                     is_chain=True if self.__dict__.get("_is_chain") else None,
                                     strict=True if self.__dict__.get("_strict") else None,
                                     ancestors=None if anc is None else anc[:k, :k])
        keep = np.asarray(selected, np.int64)
        if keep.size > 1 and not bool((keep[1:] > keep[:-1]).all()):  # selections come sorted: no sort then
            keep = np.unique(keep)
        if not keep.size or keep[0] != 0:
            raise ValueError("a subtree must contain the root")
        new_index = np.full(self.size, -1, np.int64)
        new_index[keep] = np.arange(keep.size)
        old_parents = self.parents[keep[1:]]
        orphans = keep[1:][new_index[old_parents] < 0]
        if orphans.size:
            old = int(orphans[0])
            raise ValueError(f"node {old} selected without its parent {int(self.parents[old])}: "
                             "tree would be disconnected")
        parents = np.concatenate([[-1], new_index[old_parents]])
        # closed under parents: every kept node keeps its depth
        depths = self.depths()[keep]
        depths.flags.writeable = False
        # closed under parents: a kept node's ancestors are all kept, so its row of the ancestor matrix is its
        # old row at the kept columns (when the matrix is known already: a beam tree's, issue 30)
        anc = self.__dict__.get("_ancestors")
        if anc is not None:
            anc = anc[np.ix_(keep, keep)]
            anc.flags.writeable = False
        # checked above; a strict tree's subtree keeps every (parent, child) pair it has, so it stays strict
        return TokenTree.trusted(self.tokens[keep], parents, self.log_probs[keep], depths=depths,
                                 strict=True if self.__dict__.get("_strict") else None, ancestors=anc)

    def with_strict_decrease(self, eps: float = STRICT_DECREASE_EPS) -> TokenTree:
        """Nudge ties so every child's path probability is strictly below its parent's (the same tree when
        every child already is: the nudge would change nothing)."""
        lp = self.log_probs
        if self.size <= 1 or bool(np.all(lp[1:] <= lp[self.parents[1:]] - eps)):
            return self
        lp = lp.copy()
        depth = self.depths()
        for level in range(1, int(depth.max(initial=0)) + 1):  # parents are final before their children
            nodes = np.flatnonzero(depth == level)
            lp[nodes] = np.minimum(lp[nodes], lp[self.parents[nodes]] - eps)
        # the same structure: only log_probs changed, and a minimum of finite values is finite
        return TokenTree.trusted(self.tokens, self.parents, lp, depths=depth,
                                 is_chain=self.__dict__.get("_is_chain"))
