"""Positions by depth, KV slots by flat index, and the mask rows (docs/architecture.md §2)."""

from __future__ import annotations

import torch

from adaserve.engine.batch import Segment, build_layout
from adaserve.engine.kv_cache import SequenceKV
from adaserve.engine.tree import TokenTree

PAGE = 4


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
    m = lay.mask
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
    assert lay.mask[0, 1].tolist() == [True, True, True, True, False, True]
