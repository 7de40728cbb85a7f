"""Learnt node values: sibling ranks, acceptance counted from verified trees, calibrated path values."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from adaserve.engine.model.tree import TokenTree
from adaserve.engine.speculation.acceptance import RankAcceptance, sibling_ranks


def tree() -> TokenTree:
    """root -> a (q=0.6), b (q=0.3); a -> c (q=0.5), d (q=0.4)."""
    q = {1: 0.6, 2: 0.3, 3: 0.5, 4: 0.4}
    parents = np.array([-1, 0, 0, 1, 1])
    lp = np.zeros(5)
    for i in range(1, 5):
        lp[i] = lp[parents[i]] + np.log(q[i])
    return TokenTree(np.arange(5, dtype=np.int64), parents, lp)


def test_sibling_ranks_order_children_by_the_drafts_conditional_probability() -> None:
    assert sibling_ranks(tree()).tolist() == [0, 0, 1, 0, 1]
    assert sibling_ranks(TokenTree.chain([4, 5, 6])).tolist() == [0, 0, 0]


def test_sibling_ranks_by_their_definition_ties_to_the_earlier_node() -> None:
    """rank(v) = how many of v's siblings have a greater q, or an equal q and a smaller index; one tree and forests."""
    rng = np.random.default_rng(11)
    for _ in range(200):
        size = int(rng.integers(1, 14))
        parents = np.array([-1] + [int(rng.integers(0, i)) for i in range(1, size)], np.int64)
        lq = np.log(rng.choice([0.2, 0.5, 0.8], size))  # few values: sibling ties are common
        lp = np.zeros(size)
        for i in range(1, size):
            lp[i] = lp[parents[i]] + lq[i]
        t = TokenTree(np.arange(size, dtype=np.int64), parents, lp)
        cond = lp - lp[np.maximum(parents, 0)]
        want = [0] + [sum(1 for u in range(1, size) if parents[u] == parents[v] and
                          (cond[u] > cond[v] or (cond[u] == cond[v] and u < v))) for v in range(1, size)]
        assert sibling_ranks(t).tolist() == want


def test_without_data_the_value_is_the_drafts_own_path_probability() -> None:
    t = tree()
    cal = RankAcceptance().calibrate(t)
    assert np.allclose(cal.log_probs, t.log_probs)


def test_counts_make_favourite_children_worth_what_they_were_accepted() -> None:
    acc = RankAcceptance(prior_weight=1.0, decay=1.0, q_bins=1)
    for _ in range(99):
        acc.observe(tree(), [0, 1, 3])  # the favourite child accepted at every level
    rates = acc.rates()
    assert rates[0] == pytest.approx(1.0) and rates[1] == pytest.approx(0.0)
    cal = np.exp(acc.calibrate(tree()).log_probs)
    # two trials per rank per tree (under the root and under a): rank 0 (198 + q) / 199, rank 1 q / 199
    assert cal[1] == pytest.approx((198 + 0.6) / 199) and cal[2] == pytest.approx(0.3 / 199)
    assert cal[3] == pytest.approx(cal[1] * (198 + 0.5) / 199)
    assert np.all(cal[1:] < cal[tree().parents[1:]])  # still strictly decreasing along paths


def test_only_nodes_whose_parent_was_accepted_are_trials() -> None:
    acc = RankAcceptance(decay=1.0)
    acc.observe(tree(), [0, 2])  # b accepted: a rejected; c and d under a were never tried
    assert acc.trials.sum(axis=1)[:2].tolist() == [1.0, 1.0] and acc.hits.sum(axis=1)[:2].tolist() == [0.0, 1.0]
    acc.observe(TokenTree.root(3), [0])  # nothing drafted: nothing learnt
    assert acc.trials.sum() == 2.0


def test_nodes_the_draft_was_unsure_of_learn_their_own_rate() -> None:
    # root -> a (q 0.9), b (q 0.05); a -> c (q 0.3), d (q 0.2). a, a favourite child the draft is sure of, is
    # always accepted; c, a favourite child it is unsure of, never. With q bins each learns its own rate;
    # by rank alone they share one.
    parents = np.array([-1, 0, 0, 1, 1])
    q = np.array([1.0, 0.9, 0.05, 0.3, 0.2])
    lp = np.zeros(5)
    for i in range(1, 5):
        lp[i] = lp[parents[i]] + np.log(q[i])
    t = TokenTree(np.arange(5, dtype=np.int64), parents, lp)
    binned, pooled = RankAcceptance(prior_weight=1.0, decay=1.0), RankAcceptance(prior_weight=1.0, decay=1.0, q_bins=1)
    for _ in range(99):
        binned.observe(t, [0, 1])
        pooled.observe(t, [0, 1])
    f = np.exp(binned.calibrate(t).log_probs)
    assert f[1] == pytest.approx((99 + 0.9) / 100) and f[3] / f[1] == pytest.approx(0.3 / 100)
    g = np.exp(pooled.calibrate(t).log_probs)
    assert g[1] == pytest.approx((99 + 0.9) / 199) and g[3] / g[1] == pytest.approx((99 + 0.3) / 199)


def test_bins_must_be_positive() -> None:
    with pytest.raises(ValueError, match="q_bins"):
        RankAcceptance(q_bins=0)


def _random_tree(rng: np.random.Generator, size: int) -> TokenTree:
    parents = np.array([-1] + [int(rng.integers(0, i)) for i in range(1, size)], np.int64)
    lp = np.zeros(size)
    for i in range(1, size):
        lp[i] = lp[parents[i]] + np.log(rng.uniform(0.01, 1.0))
    return TokenTree(rng.integers(0, 100, size), parents, lp)


def _reference_calibrate(acc: RankAcceptance, tree: TokenTree) -> np.ndarray:
    """log f by the definition, one node at a time (parents come first)."""
    ranks = np.minimum(sibling_ranks(tree), acc.max_rank)
    lf = np.zeros(tree.size)
    for v in range(1, tree.size):
        q = np.exp(tree.log_probs[v] - tree.log_probs[tree.parents[v]])
        b = min(int(q * acc.q_bins), acc.q_bins - 1)
        p = (acc.hits[ranks[v], b] + acc.prior_weight * q) / (acc.trials[ranks[v], b] + acc.prior_weight)
        lf[v] = lf[tree.parents[v]] + np.log(np.clip(p, 1e-9, 1 - 1e-9))
    return lf


def test_a_batch_is_calibrated_and_counted_as_tree_after_tree() -> None:
    rng = np.random.default_rng(7)
    one, many = RankAcceptance(decay=0.9), RankAcceptance(decay=0.9)
    for _ in range(20):
        trees = [_random_tree(rng, int(rng.integers(1, 12))) for _ in range(int(rng.integers(1, 6)))]
        paths = []
        for t in trees:  # an accepted path: root, then a random walk down
            path, v = [0], 0
            while (kids := np.flatnonzero(t.parents == v)).size and rng.random() < 0.7:
                v = int(rng.choice(kids))
                path.append(v)
            paths.append(path)
        for t, cal in zip(trees, many.calibrate_many(trees), strict=True):
            assert np.allclose(cal.log_probs, _reference_calibrate(one, t))
            assert cal.tokens is t.tokens and cal.parents is t.parents
        for t, p in zip(trees, paths, strict=True):
            one.observe(t, p)
        many.observe_many(trees, paths)
        assert np.allclose(one.hits, many.hits) and np.allclose(one.trials, many.trials)
    assert one.trials.sum() > 10


def test_rank_rates_wait_for_trials_then_give_each_ranks_acceptance() -> None:
    acc = RankAcceptance(q_bins=2)
    assert acc.rank_rates(2) is None  # nothing tried yet
    # a root with two children (rank 0 more likely); the rank-0 child is accepted 3 times in 4, rank 1 never
    tree = TokenTree.trusted(np.array([1, 2, 3]), np.array([-1, 0, 0]), np.log(np.array([1.0, 0.7, 0.2])))
    for i in range(40):
        acc.observe(tree, [0, 1] if i % 4 else [0])
    rates = acc.rank_rates(2)
    assert rates is not None
    assert rates[0] == pytest.approx(0.75, abs=0.02)
    assert rates[1] == 0.0
    assert acc.rank_rates(3) is None  # rank 2 never tried
    assert acc.rank_rates(0) is None


def test_a_learnt_rate_outlives_the_trees_that_stop_trying_its_rank() -> None:
    """Once the width rule has learnt that a second sibling rarely pays, it drafts chains; rank 1's decayed
    counts then run down while rank 0's keep coming. Its rate must stay readable (decay scales hits and
    trials alike), else the width falls back to the widest beam to learn it again, and back, every second
    of a busy batch."""
    acc = RankAcceptance(q_bins=1)
    wide = TokenTree.trusted(np.array([1, 2, 3]), np.array([-1, 0, 0]), np.log(np.array([1.0, 0.7, 0.2])))
    for i in range(40):
        acc.observe(wide, [0, 2] if i % 10 == 0 else [0, 1])
    learnt = acc.rank_rates(2)
    assert learnt is not None and learnt[1] == pytest.approx(0.1, abs=0.01)
    chain = TokenTree.chain([1, 2, 3])
    for _ in range(3000):  # ~9 halvings of every count: rank 1's decayed trials fall far below 16
        acc.observe_many([chain], [[0, 1, 2]])
    assert acc.trials[1].sum() < 1.0
    later = acc.rank_rates(2)
    assert later is not None and later[1] == pytest.approx(learnt[1])


@st.composite
def chains_and_paths(draw: st.DrawFn) -> tuple[list[TokenTree], list[list[int]], list[list[int]]]:
    """A batch of chains (draft log path probabilities falling down each chain), each with an accepted
    prefix, and the same batch's candidates: one length K, as a width-1 beam search drafts them."""
    k = draw(st.integers(2, 7))
    cands, verified, paths = [], [], []
    for _ in range(draw(st.integers(1, 6))):
        q = draw(st.lists(st.floats(0.001, 1.0), min_size=k - 1, max_size=k - 1))
        lp = np.concatenate(([0.0], np.cumsum(np.log(q))))
        cands.append(TokenTree.trusted(np.arange(k), np.arange(-1, k - 1), lp))
        size = draw(st.integers(1, k))  # the selected prefix
        verified.append(TokenTree.trusted(np.arange(size), np.arange(-1, size - 1), lp[:size]))
        paths.append(list(range(draw(st.integers(1, size)))))
    return cands, verified, paths


@settings(max_examples=60, deadline=None)
@given(chains_and_paths(), st.integers(1, 8))
def test_chains_take_a_shortcut_to_the_same_bits_as_the_forest(batch, q_bins: int) -> None:
    """Width-1 beam searches draft chains: calibrate_many and observe_many read them as one [n, K] array and
    one index list; the counts and the calibrated values equal the general forest pass bit for bit."""
    cands, verified, paths = batch
    fast, slow = RankAcceptance(q_bins=q_bins), RankAcceptance(q_bins=q_bins)
    general = pytest.MonkeyPatch()
    for _ in range(3):
        fast.observe_many(verified, paths)
        with general.context() as m:
            m.setattr(RankAcceptance, "_observe_chains", lambda *_: False)
            slow.observe_many(verified, paths)
        assert np.array_equal(fast.hits, slow.hits) and np.array_equal(fast.trials, slow.trials)
        assert np.array_equal(fast.tried, slow.tried)
    got = fast.calibrate_many(cands)
    with general.context() as m:
        m.setattr(RankAcceptance, "_calibrate_chains", lambda self, trees: self.calibrate_many(
            [TokenTree.trusted(t.tokens, t.parents, t.log_probs, is_chain=False) for t in trees]))
        want = slow.calibrate_many(cands)
    for g, w in zip(got, want, strict=True):
        assert np.array_equal(g.log_probs, w.log_probs)
        # each pass seeds the decrease selection reads; both equal what the values say
        fresh = TokenTree.from_lists(g.tokens.tolist(), g.parents.tolist(), g.log_probs).strictly_decreasing
        assert g.strictly_decreasing == w.strictly_decreasing == fresh


def test_a_path_that_is_not_a_prefix_is_counted_by_the_forest() -> None:
    chain = TokenTree.chain([1, 2, 3, 4])
    assert not RankAcceptance()._observe_chains([chain], [[0, 2, 3]])  # the shortcut declines it
    a, b = RankAcceptance(), RankAcceptance()
    a.observe_many([chain], [[0, 2, 3]])  # not what verification accepts on a chain, but counted as given
    b.observe_many([chain], [[0, 1]])
    assert a.trials.sum() == 2 and a.hits.sum() == 1  # node 1 (missed), node 3 (under accepted node 2, hit)
    assert b.trials.sum() == 2 and b.hits.sum() == 1  # node 1 (hit), node 2 (missed)
    with pytest.raises(ValueError):
        a.observe_many([chain, chain], [[0]])


def test_a_lone_tree_takes_a_shortcut_to_the_same_bits_as_the_forest(monkeypatch: pytest.MonkeyPatch) -> None:
    """One request's tree (``_calibrate_lone``, ``_observe_lone``: its nodes in Python floats) is calibrated and
    counted to the forest pass's bits: the same log f, the same decrease, the same hits, trials and tries, over
    hundreds of trees whose counts build on each other (ties between siblings included)."""
    rng = np.random.default_rng(30)
    fast, slow = RankAcceptance(decay=0.97, q_bins=4, max_rank=2), RankAcceptance(decay=0.97, q_bins=4, max_rank=2)
    forest = pytest.MonkeyPatch()
    for case in range(400):
        tree = _random_tree(rng, int(rng.integers(2, 14)))
        if case % 4 == 0:  # siblings of one value: their ranks fall to the lower index
            lp = tree.log_probs.copy()
            lp[tree.parents == 0] = -0.5
            tree = TokenTree(tree.tokens, tree.parents, np.where(tree.parents > 0, np.minimum(lp, -0.6), lp))
        path, v = [0], 0
        while (kids := np.flatnonzero(tree.parents == v)).size and rng.random() < 0.7:
            v = int(rng.choice(kids))
            path.append(v)
        got = fast.calibrate_many([tree])[0]
        with forest.context() as m:
            m.setattr(RankAcceptance, "_calibrate_lone", lambda *_: None)
            m.setattr(RankAcceptance, "_observe_lone", lambda *_: False)
            want = slow.calibrate_many([tree])[0]
            slow.observe_many([tree], [path])
        assert np.array_equal(got.log_probs, want.log_probs), case
        assert got.strictly_decreasing == want.strictly_decreasing
        fast.observe_many([tree], [path])
        assert np.array_equal(fast.hits, slow.hits) and np.array_equal(fast.trials, slow.trials), case
        assert np.array_equal(fast.tried, slow.tried)
    assert fast.trials[1:].sum() > 10 and fast.hits.sum() > 10  # ranks past the first were counted


def test_a_lone_tree_with_a_nan_difference_takes_the_forest_pass() -> None:
    acc = RankAcceptance()
    tree = TokenTree.trusted(np.array([1, 2, 3]), np.array([-1, 0, 0]), np.array([0.0, np.nan, -1.0]))
    assert acc._lone_cells(tree) is None
    assert acc._calibrate_lone(tree) is None and not acc._observe_lone(tree, [0])
