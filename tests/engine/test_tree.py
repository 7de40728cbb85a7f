from __future__ import annotations

import numpy as np
import pytest

from adaserve.engine.tree import TokenTree


def example() -> TokenTree:
    #      0
    #    1   2
    #   3 4   5
    return TokenTree.from_lists([10, 11, 12, 13, 14, 15], [-1, 0, 0, 1, 1, 2], np.log([1, .6, .3, .4, .1, .2]))


def test_depths_and_ancestors() -> None:
    t = example()
    assert t.depths().tolist() == [0, 1, 1, 2, 2, 2]
    anc = t.ancestor_matrix()
    assert anc[3].tolist() == [True, True, False, True, False, False]
    assert anc[5].tolist() == [True, False, True, False, False, True]
    assert anc.diagonal().all()
    assert t.children() == [[1, 2], [3, 4], [5], [], [], []]


def test_subtree_reindexes_and_refuses_orphans() -> None:
    t = example()
    s = t.subtree([0, 2, 5])
    assert s.tokens.tolist() == [10, 12, 15]
    assert s.parents.tolist() == [-1, 0, 1]
    with pytest.raises(ValueError, match="without its parent"):
        t.subtree([0, 3])
    with pytest.raises(ValueError, match="root"):
        t.subtree([1, 3])


@pytest.mark.parametrize("parents", [[0, 0], [-1, 1], [-1, 0, 5]])
def test_invalid_topology_rejected(parents: list[int]) -> None:
    with pytest.raises(ValueError):
        TokenTree.from_lists(list(range(len(parents))), parents)


def test_nan_log_prob_fails_loudly() -> None:
    with pytest.raises(ValueError, match="NaN"):
        TokenTree.from_lists([1, 2], [-1, 0], [0.0, float("nan")])


def test_strict_decrease_nudges_ties() -> None:
    t = TokenTree.from_lists([1, 2, 3], [-1, 0, 1], [0.0, 0.0, 0.0]).with_strict_decrease()
    assert t.log_probs[0] > t.log_probs[1] > t.log_probs[2]


def test_chain_and_root() -> None:
    c = TokenTree.chain([4, 5, 6])
    assert c.parents.tolist() == [-1, 0, 1]
    assert c.depths().tolist() == [0, 1, 2]
    assert TokenTree.root(9).size == 1
