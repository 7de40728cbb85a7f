"""scripts/served-forward-split.py: each shape's iterations add up to the timed steps, every drafted shape is priced
both ways, and bad settings are a CLI error (exit 2, no traceback)."""

from __future__ import annotations

import subprocess
import sys

from tests.scripts.helpers import SCRIPTS, load_script


def test_a_short_run_splits_each_shape_by_model() -> None:
    split = load_script("served-forward-split.py")
    report = split.run("demo-tiny", requests=2, steps=6, warmup=1, host_cost=False)
    shapes = report["shapes"]
    assert sum(s["iterations"] for s in shapes.values()) == 6
    for name, s in shapes.items():
        assert s["target_ms"] > 0 and s["target_predicted_ms"] > 0
        if name == "plain":
            assert s["draft_ms"] == s["draft_predicted_ms"] == s["draft_priced_as_levels_ms"] == 0
        else:
            assert s["draft_ms"] > 0 and s["draft_predicted_ms"] > 0 and s["draft_priced_as_levels_ms"] > 0
            if name.split()[0].endswith("x1"):  # a chain: its catch-up feeds at least the roots, a level's tokens
                assert s["draft_predicted_ms"] >= s["draft_priced_as_levels_ms"]
    assert report["draft_cost_model"]["source"] in ("initial", "scaled", "refit")
    assert report["budget"] >= 1 and report["d_max"] >= 1


def test_bad_settings_are_a_cli_error() -> None:
    out = subprocess.run([sys.executable, str(SCRIPTS / "served-forward-split.py"), "--requests", "0"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "must be >= 1" in out.stderr and "Traceback" not in out.stderr
