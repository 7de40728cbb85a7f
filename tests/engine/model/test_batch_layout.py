"""Positions by depth, KV slots by flat index, and the mask rows (docs/architecture.md §2)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from adaserve.engine.model.attention.masks import MaskIndex, fill_grid_mask, flat_mask, grid_mask, padded_mask
from adaserve.engine.model.batch import BatchLayout, DeviceNodes, Segment, build_layout
from adaserve.engine.model.kv_cache import SequenceKV
from adaserve.engine.model.tree import TokenTree

PAGE = 4
CPU = torch.device("cpu")


def dense_mask(lay: BatchLayout) -> torch.Tensor:
    """[B, Qmax, Kmax]: the torch backend's padded grid over the whole batch."""
    b = len(lay.segments)
    q_max, k_max = max(s.num_new for s in lay.segments), max(lay.kv_lens)
    return padded_mask(MaskIndex(lay, CPU), torch.arange(b), q_max, k_max)


def test_layout_of_two_requests() -> None:
    a = SequenceKV(pages=[7, 2], length=5)  # 5 committed tokens, tree of 3 nodes
    b = SequenceKV(pages=[0], length=2)  # 2 committed tokens, a lone root
    tree = TokenTree.from_lists([50, 51, 52], [-1, 0, 0])
    lay = build_layout([Segment(a, 5, tree), Segment(b, 2, TokenTree.root(60))], page_size=PAGE,
                       device=torch.device("cpu"))
    assert lay.input_ids.tolist() == [50, 51, 52, 60]
    assert lay.positions.tolist() == [5, 6, 6, 2]  # siblings share a position
    # token index 5,6,7 of request a live in page 2 (index 4..7): slots 2*4 + 1..3
    assert lay.write_slots.tolist() == [9, 10, 11, 2]
    assert lay.qo_indptr == [0, 3, 4]
    assert lay.kv_lens == [8, 3]
    m = dense_mask(lay)
    assert m.shape == (2, 3, 8)
    assert m[0, 0].tolist() == [True] * 5 + [True, False, False]
    assert m[0, 2].tolist() == [True] * 5 + [True, False, True]  # node 2 sees root and itself, not node 1
    assert m[1, 0, :3].tolist() == [True, True, True] and not m[1, 0, 3:].any()
    assert m[1, 1].tolist() == [True] + [False] * 7  # padded query row sees key 0 only


def test_cached_tree_nodes_are_keys_not_queries() -> None:
    s = SequenceKV(pages=[1, 3], length=3)
    tree = TokenTree.from_lists([1, 2, 3, 4], [-1, 0, 0, 1])
    lay = build_layout([Segment(s, 2, tree, num_cached=2)], page_size=PAGE, device=torch.device("cpu"))
    assert lay.input_ids.tolist() == [3, 4]
    assert lay.positions.tolist() == [3, 4]
    assert lay.write_slots.tolist() == [12, 13]  # token index 4, 5 -> page 3 offsets 0, 1
    assert dense_mask(lay)[0, 1].tolist() == [True, True, True, True, False, True]


# ---- random ragged batches against the definition, token by token ----------------------------------
def path_nodes(tree: TokenTree, node: int) -> set[int]:
    out = set()
    while node >= 0:
        out.add(node)
        node = int(tree.parents[node])
    return out


def depth_of(tree: TokenTree, node: int) -> int:
    return len(path_nodes(tree, node)) - 1


def reference_block(seg: Segment, window: int | None = None) -> torch.Tensor:
    """[num_new, kv_len] bool straight from §2: the prefix, then the node's own path; window by position."""
    p, c, tree = seg.prefix_len, seg.num_cached, seg.tree
    out = torch.zeros(seg.num_new, seg.kv_len, dtype=torch.bool)
    for i in range(seg.num_new):
        node = c + i
        q_pos = p + depth_of(tree, node)
        for k in range(seg.kv_len):
            seen = k < p or (k - p) in path_nodes(tree, node)
            k_pos = k if k < p else p + depth_of(tree, k - p)
            out[i, k] = seen and (window is None or q_pos - k_pos < window)
    return out


def random_batch(rng: np.random.Generator, *, page_size: int = PAGE, max_tree: int = 10) -> list[Segment]:
    from tests.engine.model.test_tree_attention import random_tree

    segs = []
    for _ in range(int(rng.integers(1, 6))):
        size = int(rng.integers(1, max_tree))
        tree = random_tree(rng, size, 97) if rng.random() < 0.6 else TokenTree.chain(rng.integers(2, 97, size).tolist())
        prefix = int(rng.integers(0, 20))
        cached = int(rng.integers(0, tree.size))
        pages = rng.permutation(100)[: -(-(prefix + tree.size) // page_size) + int(rng.integers(0, 2))].tolist()
        segs.append(Segment(SequenceKV(pages=pages), prefix, tree, num_cached=cached))
    return segs


@pytest.mark.parametrize("window", [None, 3])
def test_masks_equal_the_definition(window: int | None) -> None:
    rng = np.random.default_rng(11)
    for _ in range(30):
        segs = random_batch(rng)
        lay = build_layout(segs, page_size=PAGE, device=CPU)
        index = MaskIndex(lay, CPU)
        blocks = [reference_block(s, window) for s in segs]
        assert torch.equal(flat_mask(index, window), torch.cat([b.reshape(-1) for b in blocks]))
        q_max, k_max = max(s.num_new for s in segs) + 1, max(lay.kv_lens) + 2  # extra padding on both axes
        dense = padded_mask(index, torch.arange(len(segs)), q_max, k_max, window)
        for b, (s, block) in enumerate(zip(segs, blocks, strict=True)):
            assert torch.equal(dense[b, : s.num_new, : s.kv_len], block)
            assert not dense[b, : s.num_new, s.kv_len :].any()
            assert dense[b, s.num_new :, 0].all() and not dense[b, s.num_new :, 1:].any()  # padded rows


def test_layout_of_random_batches_token_by_token() -> None:
    rng = np.random.default_rng(12)
    for _ in range(30):
        segs = random_batch(rng)
        lay = build_layout(segs, page_size=PAGE, device=CPU)
        ids, pos, slots = [], [], []
        for s in segs:
            for node in range(s.num_cached, s.tree.size):
                index = s.prefix_len + node
                ids.append(int(s.tree.tokens[node]))
                pos.append(s.prefix_len + depth_of(s.tree, node))
                slots.append(s.seq.pages[index // PAGE] * PAGE + index % PAGE)
        assert lay.input_ids.tolist() == ids
        assert lay.positions.tolist() == pos
        assert lay.write_slots.tolist() == slots
        assert lay.kv_lens == [s.kv_len for s in segs]
        for b, s in enumerate(segs):
            n_pages = -(-s.kv_len // PAGE)
            assert lay.page_table[b, :n_pages].tolist() == s.seq.pages[:n_pages]
        assert lay.all_chains == all(s.tree.is_chain for s in segs)


def test_too_few_pages_is_refused() -> None:
    with pytest.raises(ValueError, match="pages"):
        build_layout([Segment(SequenceKV(pages=[1]), 3, TokenTree.chain([1, 2, 3]))], page_size=PAGE, device=CPU)


# ---- the torch backend's grid mask (bounds and cells, issue 30) against the rule -------------------
def grid_of(segs: list[Segment], members: list[int], q_max: int, k_max: int, window: int | None,
            ancestors: torch.Tensor | None = None) -> torch.Tensor:
    gm = grid_mask(segs, members, q_max, k_max, window, device_rows=ancestors is not None)
    t = {name: None if (a := getattr(gm, name)) is None else torch.from_numpy(a) for name in ("hi", "lo", "cells")}
    values = None if gm.src is None or ancestors is None else ancestors.reshape(-1)[torch.from_numpy(gm.src)]
    return fill_grid_mask(torch.arange(k_max), t["hi"], t["lo"], t["cells"], values)


@pytest.mark.parametrize("window", [None, 3])
def test_grid_mask_equals_the_rule(window: int | None) -> None:
    """Every cell of the padded grid, padding rows and columns included, for the whole batch and a subset."""
    rng = np.random.default_rng(13)
    for _ in range(40):
        segs = random_batch(rng)
        lay = build_layout(segs, page_size=PAGE, device=CPU)
        index = MaskIndex(lay, CPU)
        for members in (list(range(len(segs))), sorted(rng.permutation(len(segs))[: max(1, len(segs) // 2)])):
            q_max = max(segs[b].num_new for b in members) + int(rng.integers(0, 2))
            k_max = max(segs[b].kv_len for b in members) + int(rng.integers(0, 3))
            want = padded_mask(index, torch.as_tensor(members), q_max, k_max, window)
            assert torch.equal(grid_of(segs, members, q_max, k_max, window), want)


def beam_batch(rng: np.random.Generator, n: int, levels: list[int]) -> tuple[list[Segment], list[TokenTree]]:
    """n beam trees of one shape (level sizes ``levels``, random parents in the level above), and the
    segments of a beam step over them: placeholder trees (every level under the previous level's first
    node), the last level new, as speculate.py lays them out."""
    sizes = [1, *levels]
    starts = np.cumsum([0, *sizes])
    shape = [-1] + [int(starts[lvl - 1]) for lvl in range(1, len(sizes)) for _ in range(sizes[lvl])]
    m = int(starts[-1])
    placeholder = TokenTree.from_lists([0] * m, shape)
    trees, segs = [], []
    for _ in range(n):
        parents = [-1] + [int(rng.integers(starts[lvl - 1], starts[lvl])) for lvl in range(1, len(sizes))
                          for _ in range(sizes[lvl])]
        trees.append(TokenTree.from_lists(rng.integers(2, 97, m).tolist(), parents))
        prefix = int(rng.integers(1, 20))
        pages = rng.permutation(100)[: -(-(prefix + m) // PAGE)].tolist()
        segs.append(Segment(SequenceKV(pages=pages), prefix, placeholder, num_cached=m - levels[-1]))
    return segs, trees


@pytest.mark.parametrize("window", [None, 2])
def test_grid_mask_reads_device_ancestor_rows(window: int | None) -> None:
    """Beam levels: the trees' rows live on the device and the segments hold placeholders of their shape;
    the grid equals the rule over the real trees."""
    rng = np.random.default_rng(14)
    for n, levels in [(1, [2, 2]), (3, [2, 2, 2]), (4, [3, 3])]:
        segs, trees = beam_batch(rng, n, levels)
        anc = torch.from_numpy(np.stack([t.ancestor_matrix() for t in trees]))
        ids = torch.zeros(sum(s.num_new for s in segs), dtype=torch.int64)
        lay = build_layout(segs, page_size=PAGE, device=CPU, on_device=DeviceNodes(ids, anc))
        real = [Segment(s.seq, s.prefix_len, t, s.num_cached) for s, t in zip(segs, trees, strict=True)]
        ref = MaskIndex(build_layout(real, page_size=PAGE, device=CPU), CPU)
        members = list(range(n))
        q_max, k_max = levels[-1], max(lay.kv_lens) + 1
        want = padded_mask(ref, torch.arange(n), q_max, k_max, window)
        assert want.any() and not want.all()  # the comparison is not trivial
        assert torch.equal(grid_of(segs, members, q_max, k_max, window, anc), want)


def test_a_lone_segments_layout_is_the_batch_layout() -> None:
    """``build_layout`` of one segment (``_lone_layout``) gives ``_batch_layout``'s arrays, on random segments:
    chains and trees, cached nodes, prefixes across page boundaries, ids on the host or the device."""
    from adaserve.engine.model.batch import _batch_layout

    rng = np.random.default_rng(30)
    for case in range(300):
        (seg,) = random_batch(rng)[:1]
        nodes = None
        if case % 3 == 0 and not seg.tree.is_chain:
            anc = torch.from_numpy(seg.tree.ancestor_matrix()[None].copy())
            nodes = DeviceNodes(torch.arange(seg.num_new), anc)
        got = build_layout([seg], page_size=PAGE, device=CPU, on_device=nodes)
        want = _batch_layout([seg], page_size=PAGE, device=CPU, on_device=nodes)
        for name in ("ids", "position_ids", "slots", "page_table"):
            a, b = getattr(got, name), getattr(want, name)
            assert (a is None) == (b is None), name
            if a is not None:
                assert a.dtype == b.dtype == np.int64 and np.array_equal(a, b), (name, case)
        assert (got.qo_indptr, got.kv_lens, got.page_size, got.segments) == (
            want.qo_indptr, want.kv_lens, want.page_size, want.segments)
        assert torch.equal(got.input_ids, want.input_ids) and torch.equal(got.write_slots, want.write_slots)
        assert torch.equal(got.positions, want.positions)
    with pytest.raises(ValueError, match="at least one new token"):
        build_layout([Segment(SequenceKV(pages=[0]), 0, TokenTree.chain([1]), num_cached=1)], page_size=PAGE,
                     device=CPU)
