"""scripts/cold-call-cost.py: a median per call and sweep size, every one a positive time; bad settings are a CLI
error (exit 2, no traceback)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.scripts.helpers import SCRIPTS

ROOT = Path(__file__).resolve().parents[2]


def run(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, str(SCRIPTS / "cold-call-cost.py"), *args], capture_output=True,
                          text=True, timeout=120, env=env)


def test_each_call_has_a_median_at_each_sweep() -> None:
    out = run("--sizes", "0,0.5", "--trials", "3")
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["benchmark"] == "cold-call-cost" and report["trials"] == 3
    by_size = report["us_median_by_sweep_mb"]
    assert list(by_size) == ["0", "0.5"]
    for calls in by_size.values():
        assert set(calls) == {"torch.from_numpy", "np.concatenate", "tensor[1:3]", "ndarray.reshape"}
        assert all(us > 0 for us in calls.values())


@pytest.mark.parametrize(("args", "message"), [(("--sizes", "a,b"), "numbers of MB"),
                                               (("--sizes", "-1"), "at least one size"),
                                               (("--trials", "0"), "at least 1")])
def test_bad_settings_are_a_cli_error(args: tuple[str, ...], message: str) -> None:
    out = run(*args)
    assert out.returncode == 2 and message in out.stderr and "Traceback" not in out.stderr
