"""The host-sync counter: each kind of host-device crossing is recognised, and a forbidding region raises.

These are the CPU-side checks a CUDA-graph region must pass (host_sync.py): the counts are what the
engine-only micro-benchmark reports per iteration.
"""

from __future__ import annotations

import pytest
import torch

from adaserve.engine.model.host_sync import HostSync, HostSyncError, classify, synchronize

X = torch.arange(6)


@pytest.mark.parametrize(("call", "kind"), [
    (lambda: torch.tensor([1, 2], device="cpu"), "h2d"),
    (lambda: torch.as_tensor([1, 2], device="cpu"), "h2d"),
    (lambda: X.tolist(), "d2h"),
    (lambda: X[0].item(), "d2h"),
    (lambda: bool(X[1] > 0), "d2h"),
    (lambda: int(X[1]), "d2h"),
    (lambda: X.cpu(), "d2h"),
    (lambda: X.nonzero(), "data_shape"),
    (lambda: X[X > 2], "data_shape"),
    (lambda: torch.repeat_interleave(X, X), "data_shape"),
    (lambda: torch.empty(6, dtype=torch.long).copy_(X, non_blocking=True), "async_copy"),
    (lambda: synchronize(torch.device("cpu")), "sync"),
])
def test_each_kind_is_counted_once(call, kind: str) -> None:
    with HostSync() as hs:
        call()
    assert dict(hs.counts) == {kind: 1}


@pytest.mark.parametrize("call", [
    lambda: torch.tensor([1, 2]),  # host scratch: no device named
    lambda: torch.as_tensor(X, device="cpu"),  # already a tensor: no copy from host data
    lambda: torch.repeat_interleave(X, X, output_size=15),  # the size is given: no wait
    lambda: torch.repeat_interleave(X, 2),
    lambda: X[1:3] + X[torch.tensor([0, 2])],  # slices and integer indices keep their shapes
    lambda: torch.empty(6, dtype=torch.long).copy_(X),
    lambda: X.numpy(),  # a device tensor refuses .numpy(): the copy before it (.cpu()) is the one counted
])
def test_calls_that_do_not_wait_are_not_counted(call) -> None:
    with HostSync() as hs:
        call()
    assert hs.blocking == 0 and not hs.counts


def test_forbidding_region_raises_on_a_wait_and_names_it() -> None:
    with pytest.raises(HostSyncError, match=r"Tensor\.tolist"), HostSync(forbid=True):
        X.tolist()
    with pytest.raises(HostSyncError, match="synchronize"), HostSync(forbid=True):
        synchronize(torch.device("cpu"))
    with HostSync(forbid=True) as hs:  # copies into a captured graph's static inputs are allowed
        torch.tensor([1], device="cpu")
        torch.empty(6, dtype=torch.long).copy_(X, non_blocking=True)
    assert hs.counts == {"h2d": 1, "async_copy": 1}


def test_nested_counters_both_see_a_sync_and_close_cleanly() -> None:
    with HostSync() as outer:
        with HostSync() as inner:
            synchronize(torch.device("cpu"))
        X.tolist()
    assert inner.counts == {"sync": 1}
    assert outer.counts["sync"] == 1 and outer.counts["d2h"] == 1
    assert HostSync.active == []


def test_classify_ignores_ordinary_ops() -> None:
    assert classify(torch.add, (X, X), {}) is None
    assert classify(torch.Tensor.to, (X, "cpu"), {}) is None
    assert classify(torch.Tensor.to, (X, "cpu"), {"non_blocking": True}) == "async_copy"
