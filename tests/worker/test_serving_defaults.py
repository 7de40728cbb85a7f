"""What a worker serves by default (issues 30 and 35): static shapes on for CUDA and off on a CPU (settable
from the command line and the environment), and weights ``auto`` (the option no longer hides ADASERVE_WEIGHTS)."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from adaserve.engine.build import build_engine


def test_static_shapes_default_off_on_cpu_and_settable(target_dir: Path, draft_dir: Path) -> None:
    plain = build_engine(target=target_dir, draft=draft_dir, budget=16, profile=False, progress=False)
    assert plain.engine.cfg.static_shapes is False and plain.engine.target.static is None
    static = build_engine(target=target_dir, draft=draft_dir, budget=16, profile=False, progress=False,
                          static_shapes=True)
    assert static.engine.cfg.static_shapes is True
    assert static.engine.target.static is not None and static.engine.draft is not None
    assert static.engine.draft.static is not None


def test_worker_static_shapes_option_and_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from adaserve.cli.main import build_parser
    from adaserve.cli.worker import load_settings

    monkeypatch.delenv("ADASERVE_STATIC_SHAPES", raising=False)
    args = build_parser().parse_args(["worker"])
    assert isinstance(args, argparse.Namespace)
    assert load_settings(args).static_shapes is None  # the device decides
    assert load_settings(build_parser().parse_args(["worker", "--static-shapes"])).static_shapes is True
    monkeypatch.setenv("ADASERVE_STATIC_SHAPES", "false")
    assert load_settings(args).static_shapes is False


def test_worker_weights_come_from_the_environment_unless_given(monkeypatch: pytest.MonkeyPatch) -> None:
    from adaserve.cli.main import build_parser
    from adaserve.cli.worker import load_settings

    monkeypatch.delenv("ADASERVE_WEIGHTS", raising=False)
    args = build_parser().parse_args(["worker"])
    assert load_settings(args).weights == "auto"
    monkeypatch.setenv("ADASERVE_WEIGHTS", "int8")  # before, the option's own default hid the environment
    assert load_settings(args).weights == "int8"
    assert load_settings(build_parser().parse_args(["worker", "--weights", "float"])).weights == "float"
    assert build_parser().parse_args(["up"]).weights == "auto"
