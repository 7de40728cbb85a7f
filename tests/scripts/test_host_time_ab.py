"""scripts/host-time-ab.py: the sign test and the pairs' summary it prints, a short interleaved run of one checkout
against itself (two real workers taking turns), and a clear error for a directory that is not a checkout."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

from tests.scripts.helpers import load_script

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "host-time-ab.py"


@pytest.fixture(scope="module")
def ab() -> types.ModuleType:
    return load_script("host-time-ab.py")


def test_sign_test_p(ab: types.ModuleType) -> None:
    assert ab.sign_test_p(0, 10) == pytest.approx(2 / 1024)  # every pair one way
    assert ab.sign_test_p(10, 10) == pytest.approx(2 / 1024)
    assert ab.sign_test_p(3, 10) == pytest.approx(2 * (1 + 10 + 45 + 120) / 1024)
    assert ab.sign_test_p(5, 10) == 1.0  # an even split: capped at 1
    with pytest.raises(ValueError, match="sign_test_p"):
        ab.sign_test_p(11, 10)
    with pytest.raises(ValueError, match="sign_test_p"):
        ab.sign_test_p(0, 0)


def test_summarize_pairs_in_order_and_drops_ties_from_the_test(ab: types.ModuleType) -> None:
    s = ab.summarize([2.0, 2.0, 2.0, 3.0], [1.0, 2.0, 1.5, 2.0])  # B lower, tied, lower, lower
    assert s["pairs"] == 4
    assert s["b_lower_pairs"] == 3
    assert s["sign_test_p"] == pytest.approx(ab.sign_test_p(3, 3))  # the tie is not a pair of the test
    assert s["diff_median_ms"] == pytest.approx(-0.75)  # median of -1, 0, -0.5, -1
    assert s["a_median_ms"] == 2.0 and s["b_median_ms"] == pytest.approx(1.75)
    assert s["diff_median_share"] == pytest.approx(-0.75 / 2.0)


@pytest.mark.parametrize(("measure", "mode", "weights"),
                         [("host", "spec", "float"), ("forwards", "spec", "float"), ("host", "plain", "int8")])
def test_a_checkout_against_itself(tmp_path: Path, measure: str, mode: str, weights: str) -> None:
    """Two workers on one CPU, two blocks each: every block a positive figure, paired in order; the figure is the
    host's time or the forwards' as asked, of speculative iterations (trees pinned) or plain ones, with the pair's
    layers served as ``--weights`` asks."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, str(SCRIPT), str(ROOT), str(ROOT), "--blocks", "2", "--block", "2",
                           "--max-tokens", "200", "--measure", measure, "--mode", mode, "--weights", weights],
                          capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout)
    assert report["benchmark"] == "host-time-ab" and report["pairs"] == 2 and report["measure"] == measure
    assert len(report["a_blocks_ms"]) == len(report["b_blocks_ms"]) == 2
    assert all(ms > 0 for ms in report["a_blocks_ms"] + report["b_blocks_ms"])
    assert report["mode"] == mode and report["shape"] == ("4,2" if mode == "spec" else None)
    assert report["policies"] == [{"spec": "adaserve", "plain": "incremental"}[mode]] * 2  # what each worker ran
    assert report["requests"] == 1
    assert report["weights"] == weights and report["served_weights"] == [weights] * 2  # what each worker served
    assert report["cpu"] in os.sched_getaffinity(0)
    assert 0.0 <= report["sign_test_p"] <= 1.0


def test_not_a_checkout_is_a_cli_error(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path), str(ROOT)], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 2
    assert "not a checkout of adaserve" in done.stderr
    assert "Traceback" not in done.stderr
