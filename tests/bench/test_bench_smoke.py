"""A short real-time bench on the demo pair: the report's shape and invariants, every request counted."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from adaserve.bench.workload import WorkloadConfig, build_workload

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "models" / "demo"


@pytest.mark.skipif(not (DEMO / "target" / "config.json").is_file(), reason="demo pair not in this checkout")
def test_short_bench_report(tmp_path: Path) -> None:
    out, png = tmp_path / "report.json", tmp_path / "report.png"
    res = subprocess.run(
        [sys.executable, "-m", "adaserve", "bench", "--target", str(DEMO / "target"), "--draft", str(DEMO / "draft"),
         "--policies", "adaserve,incremental,chain:2,hf", "--rps", "1.5,3", "--duration", "3", "--budget", "8",
         "--max-tokens", "12", "--json", str(out), "--plot", str(png)],
        capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["baseline_tpot_ms"] > 0
    assert report["config"]["prefix_caching"] is False  # the bench repeats prompts: caching only when asked for
    rows = report["results"]
    assert {r["policy"] for r in rows} == {"adaserve", "incremental", "chain:2", "hf"}
    for rate in (1.5, 3.0):
        expected = len(build_workload(WorkloadConfig(rate, 3.0, baseline_tpot_ms=report["baseline_tpot_ms"],
                                                     max_tokens_cap=12)))
        for r in (r for r in rows if r["rate_rps"] == rate):
            assert r["requests"] == expected  # every request accounted for
            assert sum(c["requests"] for c in r["per_class"].values()) == r["requests"]
            assert 0.0 <= r["scheduler_time_share"] <= 1.0
            if r["policy"] != "hf":
                assert r["outputs_equal_reference"] == 1.0  # lossless: same greedy tokens as every policy
            # the budgeted policy's selection is measured against Algorithm 1; the others have no budget to share
            gap = r.get("selection_vs_optimal")
            assert (gap is not None) == (r["policy"] == "adaserve")
            if gap is not None and gap["optimal_share"] is not None:
                assert 0.0 <= gap["optimal_share"] <= 1.0
    assert set(report["adaserve_vs_best_other"]) == {"1.5", "3"}
    assert png.stat().st_size > 1000
