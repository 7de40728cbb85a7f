"""scripts/int8-head-bench.py: both ways of refining the int8 head and drawing from it, timed per row count, in JSON;
bad options a clear error."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.engine.helpers import integer_kernels

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "int8-head-bench.py"


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})


def test_each_row_count_times_both_ways() -> None:
    integer_kernels()
    done = run("--rows", "1,3", "--repeats", "2", "--vocab", "200")
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout)
    assert report["benchmark"] == "int8-head" and report["head"] == [200, 576] and report["refine"] == 16
    assert [c["rows"] for c in report["cells"]] == [1, 3]
    for cell in report["cells"]:
        for way in ("torch", "native"):
            assert 0 < cell[f"{way}_min_ms"] <= cell[f"{way}_median_ms"] <= cell[f"{way}_max_ms"]
        assert cell["product_median_ms"] > 0
        assert cell["same_draws"] == cell["rows"]  # random logits: no near-tie


def test_bad_options_are_a_cli_error() -> None:
    for args in (("--rows", "0"), ("--rows", "a"), ("--repeats", "0"), ("--vocab", "16")):
        done = run(*args)
        assert done.returncode == 2, args
        assert "int8-head-bench:" in done.stderr and "Traceback" not in done.stderr
