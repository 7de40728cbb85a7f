"""scripts/host-time-breakdown.py: its timers count the calls a stage makes outside the forwards (``--count-calls``)
and the page faults inside the forwards (``--faults``), and a listed function the engine lacks is named, not a crash
(a paired run against an older commit)."""

from __future__ import annotations

import argparse
import dataclasses
import sys
import types
from collections.abc import Iterator

import pytest

from tests.scripts.helpers import load_script


@pytest.fixture(scope="module")
def breakdown() -> types.ModuleType:
    return load_script("host-time-breakdown.py")


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


def test_again_calls_a_stage_twice_and_leaves_the_second_call_out_of_every_other_figure(
        breakdown: types.ModuleType, stage_module: types.ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    clock = [0.0]  # a fake perf_counter: each call of ``inner`` takes exactly one second
    monkeypatch.setattr(breakdown.time, "perf_counter", lambda: clock[0])
    ran: list[str] = []

    def inner() -> int:
        ran.append("inner")
        clock[0] += 1.0
        return 1

    def outer() -> int:
        return stage_module.inner() + 1

    stage_module.inner, stage_module.outer = inner, outer  # type: ignore[attr-defined]
    timers = breakdown.Timers()
    timers.again = {"inner"}
    timers.wrap(stage_module.__name__, "inner")
    timers.wrap(stage_module.__name__, "outer")
    timers.on = True
    assert stage_module.outer() == 2
    assert ran == ["inner", "inner"]  # called again, its result dropped
    assert timers.calls["inner"] == 1 and timers.calls["outer"] == 1
    assert timers.again_seconds["inner"] == 1.0 and timers.again_total == 1.0
    assert timers.seconds["inner"] == 1.0  # the first call only
    assert timers.seconds["outer"] == 1.0  # one inner call, not two


@pytest.mark.parametrize(("argv", "why"), [(["--again", "Engine.step"], "not a pure timed function: Engine.step"),
                                           (["--faults", "--count-calls"], "--faults counts one engine's iterations"),
                                           (["--mode", "plain", "--shape", "4,2"], "--mode plain drafts none")])
def test_options_that_cannot_run_are_cli_errors(breakdown: types.ModuleType, monkeypatch: pytest.MonkeyPatch,
                                                capsys: pytest.CaptureFixture[str], argv: list[str], why: str) -> None:
    """``--again`` takes only pure functions; ``--faults`` runs alone; plain decoding has no trees to pin."""
    monkeypatch.setattr(sys, "argv", ["host-time-breakdown.py", *argv])
    with pytest.raises(SystemExit) as exc:
        breakdown.main()
    assert exc.value.code == 2 and why in capsys.readouterr().err


def test_shape_pins_d_and_w_and_refuses_anything_else(breakdown: types.ModuleType,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    ap = argparse.ArgumentParser(prog="host-time-breakdown.py")
    assert breakdown._pinned_shape(ap, "") is None
    shape = breakdown._pinned_shape(ap, "3,2")
    assert (shape.depth, shape.width) == (3, 2)
    for bad, why in (("0,2", "must be >= 1"), ("3", "expected D,W"), ("a,b", "expected D,W"),
                     ("1,2,3", "expected D,W")):
        with pytest.raises(SystemExit) as exc:
            breakdown._pinned_shape(ap, bad)
        assert exc.value.code == 2 and why in capsys.readouterr().err


def test_pin_shape_replaces_the_policys_choice_still_asks_it_once_and_never_stacks(
        breakdown: types.ModuleType) -> None:
    asked: list[str] = []

    @dataclasses.dataclass(frozen=True)
    class Policy:
        def tree_shape(self, view: str) -> str:
            asked.append(view)
            return "its own"

    policy, shape = Policy(), breakdown.TreeShape(3, 2)
    breakdown.pin_shape(policy, shape)
    breakdown.pin_shape(policy, shape)  # a restarted engine over the same policy object
    assert policy.tree_shape("v1") is shape and asked == ["v1"]  # asked once per iteration, not once per pin
    assert Policy().tree_shape("v2") == "its own"  # only the pinned object


def test_faults_counts_the_pages_a_forward_maps_afresh(breakdown: types.ModuleType) -> None:
    """``--faults``: a forward that touches 64 freshly mapped pages is charged at least 64 minor faults; nothing is
    counted with the option off."""
    import mmap

    import torch

    pages = 64

    class Touches(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            m = mmap.mmap(-1, pages * mmap.PAGESIZE)
            m.write(b"x" * (pages * mmap.PAGESIZE))  # each page mapped on first touch
            m.close()
            return x

    timers = breakdown.Timers()
    model = Touches()
    timers.hook(model)
    model(torch.zeros(1))
    assert timers.faults_in_forwards == 0  # off
    timers.faults = True
    model(torch.zeros(1))
    assert timers.faults_in_forwards >= pages

