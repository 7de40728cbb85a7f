"""ModelRunner's helpers: the per-segment logits joined back without a copy (issue 30)."""

from __future__ import annotations

import torch

from adaserve.engine.model.runner import joined_rows


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
