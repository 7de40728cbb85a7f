"""ModelRunner's helpers: the per-segment logits joined back without a copy (issue 30); what a forward reports."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from adaserve.engine.model.batch import Segment
from adaserve.engine.model.kv_cache import SequenceKV
from adaserve.engine.model.runner import ForwardRecord, chunk_cells, joined_rows
from adaserve.engine.model.tree import TokenTree
from tests.engine.helpers import runner


def test_consecutive_blocks_join_as_a_view() -> None:
    logits = torch.randn(7, 5)
    joined = joined_rows(list(torch.split(logits, [2, 1, 4])))
    assert torch.equal(joined, logits)
    assert joined.data_ptr() == logits.data_ptr()  # no copy
    tail = joined_rows(list(torch.split(logits, [3, 4]))[1:])
    assert torch.equal(tail, logits[3:]) and tail.data_ptr() == logits[3:].data_ptr()


def test_other_blocks_are_copied_in_order() -> None:
    logits = torch.randn(6, 5)
    a, b, c = torch.split(logits, [2, 2, 2])
    for parts in ([a, c], [b, a], [a, b.clone()], [a, torch.randn(3, 5)], [a, b.double()]):
        joined = joined_rows(parts)
        assert torch.equal(joined, torch.cat(parts))
        assert joined.data_ptr() != a.data_ptr()  # a copy: a view would read the wrong rows
    strided = torch.randn(5, 2).t()  # [2, 5], not contiguous
    assert torch.equal(joined_rows([strided, a]), torch.cat([strided, a]))


def test_blocks_of_another_storage_right_after_the_first_are_copied() -> None:
    """Two storages end to end in memory (each a tensor over its own rows of one numpy array): the second's rows
    start where the first's end, but a view of the first's storage cannot reach them."""
    rows = np.arange(20, dtype=np.float32).reshape(4, 5)
    a, b = torch.from_numpy(rows[:2]), torch.from_numpy(rows[2:])
    assert b.data_ptr() == a.data_ptr() + a.nbytes  # adjacent
    assert a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr()
    joined = joined_rows([a, b])
    assert torch.equal(joined, torch.cat([a, b])) and joined.data_ptr() != a.data_ptr()


def test_a_forward_reports_its_tokens_context_and_attention_cells(target_dir: Path) -> None:
    """What the cost model is fitted on (cost_model.py): a prompt chunk of 6 over 4 cached tokens and a tree of 3 new
    nodes (2 cached) over 9: 9 new tokens, 4 + 11 context, and the cells of each as a causal chunk, 6 x 4 + 6 x 7 / 2
    and 3 x 11 + 3 x 4 / 2: every new token reads the cached keys and the chunk's keys up to itself."""
    r = runner(target_dir)
    a, b = SequenceKV(), SequenceKV()
    r.forward([Segment(a, 0, TokenTree.chain([5, 6, 7, 8])), Segment(b, 0, TokenTree.chain(list(range(2, 11))))],
              all_logits=[False, False])
    tree = TokenTree.chain([3, 4, 5, 6, 7])
    r.forward([Segment(b, 9, tree.subtree(range(2)))], all_logits=[True])
    records: list[ForwardRecord] = []
    r.forward_listeners.append(records.append)
    r.forward([Segment(a, 4, TokenTree.chain([9, 9, 9, 9, 9, 9])), Segment(b, 9, tree, num_cached=2)],
              all_logits=[False, True])
    assert [(x.n_new, x.n_context, x.n_cells) for x in records] == [(9, 15, 6 * 4 + 21 + 3 * 11 + 6)]
    assert chunk_cells(6, 4) + chunk_cells(3, 11) == 6 * 4 + 21 + 3 * 11 + 6
