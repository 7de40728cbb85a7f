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


@pytest.mark.skipif(not (DEMO / "target" / "config.json").is_file(), reason="demo pair not in this checkout")
def test_bench_with_a_tensor_parallel_target(tmp_path: Path) -> None:
    """``--tensor-parallel-size 2``: the target sharded over two CPU ranks (gloo), every variant's engine over it;
    the speculating policy reproduces incremental decoding's tokens, and the report names the size."""
    out = tmp_path / "report.json"
    res = subprocess.run(
        [sys.executable, "-m", "adaserve", "bench", "--model", "demo-tiny", "--tensor-parallel-size", "2",
         "--policies", "incremental,adaserve", "--rps", "2", "--duration", "2", "--budget", "8",
         "--max-tokens", "8", "--json", str(out)],
        capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["config"]["tensor_parallel_size"] == 2
    assert report["lossless"] is True
    rows = report["results"]
    assert {r["policy"] for r in rows} == {"incremental", "adaserve"} and all(r["requests"] > 0 for r in rows)


def test_bench_refuses_more_ranks_than_heads() -> None:
    res = subprocess.run([sys.executable, "-m", "adaserve", "bench", "--model", "demo-tiny",
                          "--tensor-parallel-size", "5"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 2, res.stderr[-2000:]
    assert "tensor parallel size 5 is more than num_attention_heads=4" in res.stderr


@pytest.mark.skipif(not (DEMO / "target" / "config.json").is_file(), reason="demo pair not in this checkout")
def test_the_wall_clock_measures_selections_after_the_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """On the wall clock a listener's time is the requests' time: the budget-use and Algorithm 1 measurements of
    adaserve's selections run once the run is over, never inside its iterations (they charged adaserve alone)."""
    from adaserve.bench import runner
    from adaserve.bench.budget_use import BudgetUse
    from adaserve.bench.selection_gap import SelectionGap

    serving, seen = [False], {"use": 0, "gap": 0}
    real_serve, real_use, real_gap = runner.serve, BudgetUse.observe, SelectionGap.observe

    def serve(*args: object, **kwargs: object) -> object:
        serving[0] = True
        try:
            return real_serve(*args, **kwargs)
        finally:
            serving[0] = False

    def use(self: BudgetUse, rec: object) -> None:
        assert not serving[0], "budget use measured inside a timed iteration"
        seen["use"] += 1
        real_use(self, rec)

    def gap(self: SelectionGap, rec: object) -> None:
        assert not serving[0], "Algorithm 1's records taken inside a timed iteration"
        seen["gap"] += 1
        real_gap(self, rec)

    monkeypatch.setattr(runner, "serve", serve)
    monkeypatch.setattr(BudgetUse, "observe", use)
    monkeypatch.setattr(SelectionGap, "observe", gap)
    cfg = runner.BenchConfig(target=DEMO / "target", draft=DEMO / "draft", policies=("adaserve",), rates=(2.0,),
                             duration_s=2.0, baseline_tpot_ms=5.0, max_tokens_cap=8)
    report = runner.run_bench(cfg, progress=False)
    rows = report["results"]
    assert seen["use"] == seen["gap"] == sum(r["budget_use"]["iterations"] for r in rows) > 0
    assert sum(r["selection_vs_optimal"]["iterations"] for r in rows) == seen["gap"]
