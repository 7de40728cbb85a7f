"""HostStage: every staged array comes back whole, in its dtype and shape, its own copy: joined into one counted copy
as a GPU's is (or a CPU's while a HostSync counts), taken as it is put on a CPU otherwise."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from adaserve.engine.model.host_sync import HostSync
from adaserve.engine.model.staging import HostStage


@pytest.mark.parametrize("counted", [True, False])
def test_every_array_comes_back_whole(counted: bool) -> None:
    arrays = {"a": np.arange(5), "b": np.arange(12).reshape(3, 4), "c": np.broadcast_to(np.arange(3)[:, None], (3, 2)),
              "d": np.array([[True, False, True]]), "e": [7, 8], "f": np.zeros((0,), np.int64),
              "g": np.array([0, 3, -1]), "h": np.arange(6, dtype=np.int32)[::2]}
    dtypes = {"d": torch.bool, "g": torch.bool, "h": torch.int32}
    with HostSync():  # made while a HostSync counts: joined, as a GPU's
        stage = HostStage(torch.device("cpu")) if counted else None
    stage = stage or HostStage(torch.device("cpu"))
    assert stage.join == counted
    for name, a in arrays.items():
        stage.put(name, a, dtypes.get(name, torch.int64))
    with HostSync() as hs:
        got = {name: stage.get(name) for name in arrays}
    # joined: one non-blocking copy, as a GPU's stage makes; a CPU's own: nothing to send
    assert dict(hs.counts) == ({"async_copy": 1} if counted else {}) and stage.copies == int(counted)
    for name, a in arrays.items():
        want = torch.as_tensor(np.array(a)).to(dtypes.get(name, torch.int64))
        assert got[name].dtype == want.dtype and got[name].shape == want.shape and torch.equal(got[name], want)
        assert got[name].is_contiguous()
    got["a"][0] = 99  # the device arrays are the stage's own: the caller's host array is untouched
    assert arrays["a"][0] == 0
    if not counted:  # and a host array changed after it was put leaves the staged one as it was put
        arrays["b"][0, 0] = 42
        assert int(got["b"][0, 0]) == 0


def test_a_name_is_staged_once() -> None:
    stage = HostStage(torch.device("cpu"))
    stage.put("x", np.arange(2))
    with pytest.raises(ValueError, match="already staged"):
        stage.put("x", np.arange(2))
    stage.get("x")
    with pytest.raises(ValueError, match="already staged"):
        stage.put("x", np.arange(2))
    with pytest.raises(ValueError, match="already staged"):
        stage.bind("x", torch.arange(2))
    stage.bind("y", torch.arange(3))
    assert "y" in stage and "x" in stage and "z" not in stage
    with pytest.raises(ValueError, match="already staged"):
        stage.put("y", np.arange(2))
