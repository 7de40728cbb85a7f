"""Beam search's trees from its [n, nodes] arrays (speculate.build_trees): the per-tree construction and
strict-decrease nudge, done for every request at once (issue 30). A level's picks on a CPU by the integer
kernels' ``beam_picks`` (native/picks.c): the torch ops' picks, and the kernel's tie rule."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from adaserve.engine.model.tree import TokenTree
from adaserve.engine.speculation.speculate import build_trees, expand_level
from tests.engine.helpers import use_cpu_kernels


@pytest.mark.parametrize("n", [5, 1])  # one request: its own pass (speculate._lone_tree)
@pytest.mark.parametrize("level_sizes", [[1], [1, 1, 1], [2, 2, 2], [3, 6], [2, 4, 8]])
def test_batched_trees_equal_the_per_tree_construction(level_sizes: list[int], n: int) -> None:
    rng = np.random.default_rng(len(level_sizes) * 10 + level_sizes[-1] + n)
    k = sum(level_sizes)
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


def test_a_lone_tree_is_its_batchs_tree_where_the_nudge_vanishes() -> None:
    """A path probability so small that f - eps == f (a refused token's -1e30): the tree is not strictly decreasing,
    alone (``_lone_tree``) as in a batch."""
    level_sizes = [2, 2, 2]
    pars = np.array([[0, 0, 1, 1, 3, 3]])
    lps = np.array([[-0.5, -0.7, -1e30, -1.0, -1e30, -1e30]])
    toks, roots = np.arange(6)[None], np.array([[7]])
    (lone,) = build_trees(roots, toks, pars, lps, level_sizes)
    batch = build_trees(np.repeat(roots, 2, 0), np.repeat(toks, 2, 0), np.repeat(pars, 2, 0), np.repeat(lps, 2, 0),
                        level_sizes)[1]
    assert not lone.strictly_decreasing and not batch.strictly_decreasing
    assert np.array_equal(lone.log_probs, batch.log_probs) and np.array_equal(lone.tokens, batch.tokens)
    assert np.array_equal(lone.ancestor_matrix(), batch.ancestor_matrix())


def both_picks(logits: torch.Tensor, base: np.ndarray, width: int, per_node: int | None,
               monkeypatch: pytest.MonkeyPatch) -> dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """``expand_level`` of [n * F, V] logits by the torch ops and by the integer kernels."""
    n, f = base.shape
    out = {}
    for picks in ("torch", "native"):
        use_cpu_kernels(picks, monkeypatch)
        out[picks] = expand_level(list(logits.view(n, f, -1)), base, width=width, per_node=per_node)
    return out


@pytest.mark.parametrize(("n", "f", "v", "width", "per_node"), [
    (1, 1, 4096, 2, None), (3, 2, 4096, 2, None), (4, 3, 1000, 3, None), (2, 4, 37, 4, None), (5, 1, 4096, 1, None),
    (3, 2, 4096, 1, 1), (2, 3, 101, 2, 3), (2, 1, 5, 8, None), (1, 2, 49152, 4, None), (6, 2, 4099, 2, None)])
def test_native_picks_are_the_torch_ops_picks(n: int, f: int, v: int, width: int, per_node: int | None,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Random logits (no ties): the same tokens and parents, in the same order, and the same log path
    probabilities to float32 rounding; vocabularies that are and are not a multiple of the kernel's 8 lanes."""
    gen = torch.Generator().manual_seed(n * 1000 + f * 100 + v)
    logits = 3 * torch.randn(n * f, v, generator=gen)
    base = np.log(np.random.default_rng(v).uniform(0.05, 1.0, (n, f)))
    got = both_picks(logits, base, width, per_node, monkeypatch)
    (tok, par, val), (n_tok, n_par, n_val) = got["torch"], got["native"]
    assert n_tok.tolist() == tok.tolist() and n_par.tolist() == par.tolist()
    assert np.allclose(n_val, val, rtol=0, atol=1e-5)


def reference_picks(logits: np.ndarray, base: np.ndarray, width: int) -> tuple[list[list[int]], list[list[int]]]:
    """The kernel's rule in plain Python: a row's k greatest logits, ties to the lower token id; a request's top
    ``width`` candidates j = f * k + i by score, ties to the lower j."""
    n, f = base.shape
    rows = logits.reshape(n, f, -1).astype(np.float64)
    k = min(width, rows.shape[-1])
    toks, pars = [], []
    for b in range(n):
        cands = []
        for node in range(f):
            row = rows[b, node]
            order = sorted(range(len(row)), key=lambda t: (-row[t], t))[:k]
            lse = np.log(np.exp(row - row.max()).sum()) + row.max()
            cands += [(base[b, node] + row[t] - lse, node * k + i, t, node) for i, t in enumerate(order)]
        best = sorted(cands, key=lambda c: (-c[0], c[1]))[:width]
        toks.append([c[2] for c in best])
        pars.append([c[3] for c in best])
    return toks, pars


@pytest.mark.parametrize("width", [1, 2, 3])
def test_native_picks_break_ties_by_the_lower_id(width: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Logits of a few values, so every row's top is repeated and scores tie across frontier nodes: the
    kernel takes the lower token id within a row and the lower candidate across them (torch.topk leaves
    either unspecified)."""
    use_cpu_kernels("native", monkeypatch)
    gen = torch.Generator().manual_seed(width)
    n, f = 3, 2
    logits = torch.randint(0, 3, (n * f, 203), generator=gen).float()
    base = np.zeros((n, f))  # every frontier node alike: ties between nodes too
    tok, par, _ = expand_level(list(logits.view(n, f, -1)), base, width=width)
    want_tok, want_par = reference_picks(logits.numpy(), base, width)
    assert tok.tolist() == want_tok and par.tolist() == want_par
