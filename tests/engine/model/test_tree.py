from __future__ import annotations

import numpy as np
import pytest

from adaserve.engine.model.tree import TokenTree


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


def test_depth_is_the_deepest_level() -> None:
    assert TokenTree.root(5).depth == 0
    assert TokenTree.chain([1, 2, 3, 4]).depth == 3
    tree = TokenTree.from_lists([1, 2, 3, 4, 5], [-1, 0, 0, 2, 0], [0.0, -1.0, -1.5, -2.0, -3.0])
    assert not tree.is_chain and tree.depth == int(tree.depths().max()) == 2


def test_subtree_reindexes_and_refuses_orphans() -> None:
    t = example()
    s = t.subtree([0, 2, 5])
    assert s.tokens.tolist() == [10, 12, 15]
    assert s.parents.tolist() == [-1, 0, 1]
    with pytest.raises(ValueError, match="without its parent"):
        t.subtree([0, 3])
    with pytest.raises(ValueError, match="root"):
        t.subtree([1, 3])


def test_subtree_keeps_a_known_ancestor_matrix() -> None:
    """A subtree of a tree whose ancestor matrix is known takes its rows at the kept nodes: the subtree's own."""
    t = example()
    t.ancestor_matrix()
    for keep in ([0], [0, 1], [0, 2, 5], [0, 1, 3, 4], [0, 1, 2, 4, 5]):
        s = t.subtree(keep)
        assert "_ancestors" in s.__dict__
        fresh = TokenTree.from_lists(s.tokens.tolist(), s.parents.tolist())
        assert np.array_equal(s.ancestor_matrix(), fresh.ancestor_matrix())
        assert not s.ancestor_matrix().flags.writeable
    assert "_ancestors" not in example().subtree([0, 1]).__dict__  # not known: not computed here either


def test_a_prefix_subtree_equals_the_general_path() -> None:
    """Selecting nodes 0 .. k - 1 (a list, as the engine passes it) keeps every index: the same arrays, depths,
    ancestor rows, chain flag and strictness as the reindexing path (an array selection) gives."""
    for t in (example(), TokenTree.chain([4, 5, 6, 7])):
        t.ancestor_matrix()
        for k in range(1, t.size):
            fast, general = t.subtree(list(range(k))), t.subtree(np.arange(k))
            for a, b in ((fast.tokens, general.tokens), (fast.parents, general.parents),
                         (fast.log_probs, general.log_probs), (fast.depths(), general.depths()),
                         (fast.ancestor_matrix(), general.ancestor_matrix())):
                assert np.array_equal(a, b)
            assert fast.is_chain == general.is_chain and fast.strictly_decreasing == general.strictly_decreasing
            assert not fast.depths().flags.writeable and not fast.ancestor_matrix().flags.writeable


def test_subtree_of_every_node_is_the_tree() -> None:
    """A selection of every node, in order (the engine's list), is the tree itself (issue 30: no copy per request);
    any other form of it goes the general way, to the same arrays."""
    t = example()
    assert t.subtree(list(range(t.size))) is t
    for same in (np.arange(t.size), list(range(t.size))[::-1], tuple(range(t.size))):
        s = t.subtree(same)
        assert s is not t
        for a, b in ((s.tokens, t.tokens), (s.parents, t.parents), (s.log_probs, t.log_probs)):
            assert np.array_equal(a, b)
        assert np.array_equal(s.depths(), t.depths())
    assert t.subtree([0, 1, 2, 3, 4]).size == 5  # one short: not the tree
    assert TokenTree.root(7).subtree([0]).tokens.tolist() == [7]


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


def test_roots_are_each_tokens_root() -> None:
    """``roots`` builds what ``root`` does for each token (fields, dtypes, the caches it seeds), each tree its own
    token; their shared arrays are read-only, so no tree can change another's."""
    tokens = [9, 4, 9, 2**40]
    trees = TokenTree.roots(tokens)
    assert len(trees) == len(tokens) and TokenTree.roots([]) == []
    for tok, tree in zip(tokens, trees, strict=True):
        one = TokenTree.root(tok)
        assert tree.__dict__.keys() == one.__dict__.keys()
        for name in ("tokens", "parents", "log_probs"):
            a, b = getattr(tree, name), getattr(one, name)
            assert a.dtype == b.dtype and a.shape == b.shape and a.tolist() == b.tolist()
        assert tree.tokens.tolist() == [tok] and tree.is_chain and tree.depth == 0 and tree.strictly_decreasing
        assert tree.depths().tolist() == [0] and tree.ancestor_matrix().tolist() == [[True]]
        for shared in (tree.parents, tree.log_probs, tree.depths()):
            with pytest.raises(ValueError, match="read-only"):
                shared[0] = 1


def naive_depths_and_ancestors(parents: list[int]) -> tuple[list[int], np.ndarray]:
    m = len(parents)
    depth, anc = [0] * m, np.zeros((m, m), bool)
    for i in range(m):
        if i > 0:
            depth[i] = depth[parents[i]] + 1
            anc[i] = anc[parents[i]]
        anc[i, i] = True
    return depth, anc


@pytest.mark.parametrize("seed", range(5))
def test_vectorised_structure_equals_the_recurrence(seed: int) -> None:
    rng = np.random.default_rng(seed)
    for size in (1, 2, 3, 7, 20, 64):
        # deep and bushy trees alike: parents drawn near i (deep) or anywhere before i (bushy)
        near = rng.random() < 0.5
        parents = [-1] + [int(rng.integers(max(0, i - 2) if near else 0, i)) for i in range(1, size)]
        lp = np.log(rng.random(size))
        lp[0] = 0.0
        t = TokenTree.from_lists(rng.integers(0, 50, size).tolist(), parents, lp)
        depth, anc = naive_depths_and_ancestors(parents)
        assert t.depths().tolist() == depth
        assert np.array_equal(t.ancestor_matrix(), anc)
        expected = lp.copy()
        for i in range(1, size):
            expected[i] = min(expected[i], expected[parents[i]] - 1e-6)
        assert np.array_equal(t.with_strict_decrease().log_probs, expected)
        assert t.is_chain == (parents == list(range(-1, size - 1)))


def test_chain_structure_and_read_only_caches() -> None:
    c = TokenTree.chain(list(range(300)))
    assert c.is_chain and c.depths().tolist() == list(range(300))
    assert np.array_equal(c.ancestor_matrix(), np.tri(300, dtype=bool))
    with pytest.raises(ValueError):
        c.depths()[0] = 5  # cached: a caller must not change it for the next one


def test_subtree_of_random_selections_keeps_paths() -> None:
    rng = np.random.default_rng(3)
    t = TokenTree.from_lists(list(range(30)), [-1] + [int(rng.integers(0, i)) for i in range(1, 30)])
    for _ in range(20):
        leaf = int(rng.integers(0, 30))
        keep = {0}
        node = leaf
        while node > 0:
            keep.add(node)
            node = int(t.parents[node])
        s = t.subtree(sorted(keep, reverse=True))
        order = sorted(keep)
        assert s.tokens.tolist() == order  # tokens are the old indices here
        assert [order[p] if p >= 0 else -1 for p in s.parents.tolist()] == [int(t.parents[o]) for o in order]


def test_seeded_structure_equals_the_computed_one() -> None:
    """Trees built with their depths already known (roots, chains, subtrees: issue 30) carry exactly what
    ``depths()`` and ``is_chain`` compute from the parents, read-only."""
    rng = np.random.default_rng(7)
    parents = [-1] + [int(rng.integers(0, i)) for i in range(1, 25)]
    t = TokenTree.from_lists(list(range(25)), parents)
    # a subtree: every node whose parent is kept, from the root down (closed under parents)
    keep = [0]
    for i in range(1, 25):
        if parents[i] in keep and rng.random() < 0.7:
            keep.append(i)
    trees = [TokenTree.root(3), TokenTree.chain([5, 6, 7, 8]), t.subtree([0]), t.subtree(keep)]
    for tree in trees:
        fresh = TokenTree.from_lists(tree.tokens.tolist(), tree.parents.tolist(), tree.log_probs)
        assert tree.depths().tolist() == fresh.depths().tolist()
        assert tree.is_chain == fresh.is_chain
        with pytest.raises(ValueError):
            tree.depths()[0] = 1
    with pytest.raises(ValueError, match="root"):
        TokenTree.chain([])


def test_strict_decrease_of_a_strict_tree_is_the_tree() -> None:
    t = example()
    assert t.with_strict_decrease() is t
    tied = TokenTree.from_lists([1, 2, 3, 4], [-1, 0, 1, 1], [0.0, -1.0, -1.0, -2.0])
    nudged = tied.with_strict_decrease()
    assert nudged.log_probs.tolist() == [0.0, -1.0, -1.0 - 1e-6, -2.0]
    assert nudged.depths().tolist() == [0, 1, 2, 2]


def test_strictly_decreasing_is_computed_seeded_and_kept_by_subtrees() -> None:
    """Selection reads whether f falls from every parent to its child (``strictly_decreasing``); a builder that
    checked a whole batch seeds it, and a subtree of a strict tree is strict without a check of its own."""
    strict = TokenTree.from_lists([1, 2, 3, 4], [-1, 0, 1, 1], [0.0, -1.0, -1.5, -2.0])
    tied = TokenTree.from_lists([1, 2, 3, 4], [-1, 0, 1, 1], [0.0, -1.0, -1.0, -2.0])
    assert strict.strictly_decreasing and not tied.strictly_decreasing
    assert tied.with_strict_decrease().strictly_decreasing
    assert TokenTree.root(7).strictly_decreasing
    sub = strict.subtree([0, 1, 3])
    assert sub.__dict__.get("_strict") is True and sub.strictly_decreasing
    assert not tied.subtree([0, 1, 2]).strictly_decreasing  # the tie kept: computed, not seeded
    assert tied.subtree([0, 1, 3]).strictly_decreasing
