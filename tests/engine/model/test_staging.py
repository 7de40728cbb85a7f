"""HostStage: every staged array comes back whole, in its dtype and shape, after one counted copy."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from adaserve.engine.model.host_sync import HostSync
from adaserve.engine.model.staging import HostStage


def test_every_array_comes_back_after_one_copy() -> None:
    arrays = {"a": np.arange(5), "b": np.arange(12).reshape(3, 4), "c": np.broadcast_to(np.arange(3)[:, None], (3, 2)),
              "d": np.array([[True, False, True]]), "e": [7, 8], "f": np.zeros((0,), np.int64)}
    stage = HostStage(torch.device("cpu"))
    for name, a in arrays.items():
        stage.put(name, a, torch.bool if name == "d" else torch.int64)
    with HostSync() as hs:
        got = {name: stage.get(name) for name in arrays}
    assert dict(hs.counts) == {"async_copy": 1} and stage.copies == 1
    for name, a in arrays.items():
        want = torch.as_tensor(np.array(a))
        assert got[name].dtype == want.dtype and got[name].shape == want.shape and torch.equal(got[name], want)
    got["a"][0] = 99  # the device arrays are the stage's own: the caller's host array is untouched
    assert arrays["a"][0] == 0


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
