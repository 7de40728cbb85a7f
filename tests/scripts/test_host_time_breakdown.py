"""scripts/host-time-breakdown.py: its timers count the calls a stage makes outside the forwards (``--count-calls``),
and a listed function the engine lacks is named, not a crash (a paired run against an older commit)."""

from __future__ import annotations

import importlib.util
import sys
import types
from collections.abc import Iterator
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "host-time-breakdown.py"


@pytest.fixture(scope="module")
def breakdown() -> types.ModuleType:
    spec = importlib.util.spec_from_file_location("host_time_breakdown", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def stage_module() -> Iterator[types.ModuleType]:
    """A module with a stage that makes four calls: two Python functions, each calling one C function."""
    mod = types.ModuleType("adaserve_breakdown_fixture")

    def leaf() -> int:
        return len("ab")

    def stage() -> int:
        return leaf() + leaf()

    mod.leaf, mod.stage = leaf, stage  # type: ignore[attr-defined]
    sys.modules[mod.__name__] = mod
    yield mod
    del sys.modules[mod.__name__]


def test_a_stages_calls_are_counted_outside_forwards_and_absent_functions_named(
        breakdown: types.ModuleType, stage_module: types.ModuleType) -> None:
    timers = breakdown.Timers()
    timers.wrap(stage_module.__name__, "stage")
    timers.wrap(stage_module.__name__, "Missing.method")
    assert timers.absent == ["Missing.method"]
    timers.on = True
    sys.setprofile(timers.count)
    try:
        assert stage_module.stage() == 4
    finally:
        sys.setprofile(None)
    # the stage's own frame, two leaves and their two len calls; not the wrapper's bookkeeping
    assert timers.counted["stage"] == 5
    assert timers.counted[""] >= 5 and timers.calls["stage"] == 1
    timers.counted.clear()
    timers.forwarding = True  # inside a model's forward: nothing counts
    sys.setprofile(timers.count)
    try:
        stage_module.stage()
    finally:
        sys.setprofile(None)
    assert timers.counted["stage"] == 0
