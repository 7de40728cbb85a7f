"""Beam search's trees from its [n, nodes] arrays (speculate.build_trees): the per-tree construction and
strict-decrease nudge, done for every request at once (issue 30)."""

from __future__ import annotations

import numpy as np
import pytest

from adaserve.engine.model.tree import TokenTree
from adaserve.engine.speculation.speculate import build_trees


@pytest.mark.parametrize("level_sizes", [[1], [1, 1, 1], [2, 2, 2], [3, 6], [2, 4, 8]])
def test_batched_trees_equal_the_per_tree_construction(level_sizes: list[int]) -> None:
    rng = np.random.default_rng(len(level_sizes) * 10 + level_sizes[-1])
    n, k = 5, sum(level_sizes)
    parents, lps, start, prev = [], [], 0, [0]
    for size in level_sizes:
        # parents among the previous level's nodes (tree indices, root 0); ties with the parent's value
        parents.append(rng.choice(prev, size=(n, size)))
        prev = list(range(start + 1, start + 1 + size))
        start += size
    pars = np.concatenate(parents, axis=1)
    lps = np.round(np.log(rng.random((n, k))), 1)  # rounded: ties between parent and child happen
    lps[:, :2] = 0.0
    toks = rng.integers(0, 100, (n, k))
    roots = rng.integers(0, 100, (n, 1))
    trees = build_trees(roots, toks, pars, lps, level_sizes)
    for r, tree in enumerate(trees):
        ref = TokenTree(np.r_[roots[r], toks[r]], np.r_[-1, pars[r]], np.r_[0.0, lps[r]]).with_strict_decrease()
        assert tree.tokens.tolist() == ref.tokens.tolist()
        assert tree.parents.tolist() == ref.parents.tolist()
        assert np.array_equal(tree.log_probs, ref.log_probs)
        fresh = TokenTree.from_lists(ref.tokens.tolist(), ref.parents.tolist(), ref.log_probs)
        assert tree.depths().tolist() == fresh.depths().tolist()
        assert tree.is_chain == fresh.is_chain
        assert tree.strictly_decreasing == fresh.strictly_decreasing  # seeded from one batch check
        # seeded from one batched pass over the levels (issue 30), read-only like a computed one
        assert np.array_equal(tree.ancestor_matrix(), fresh.ancestor_matrix())
        assert not tree.ancestor_matrix().flags.writeable
