"""``adaserve bench --clock simulated``: the same seed gives the same report, and the sweeps build the
workloads they name."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from adaserve.bench.runner import BenchConfig, sweep_points, urgent_mix
from adaserve.cli.main import main

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "models" / "demo"
WALL_CLOCK_FIELDS = {"real_s"}  # host time a run took: the one thing a simulated report may not repeat


def strip_wall_clock(x: Any) -> Any:
    """The report without host-time fields; everything else must repeat exactly. (The few-row kernels are
    picked by timing, once per machine: both runs read the same kernel plan from the cache directory.)"""
    if isinstance(x, dict):
        return {k: strip_wall_clock(v) for k, v in x.items() if k not in WALL_CLOCK_FIELDS}
    if isinstance(x, list):
        return [strip_wall_clock(v) for v in x]
    return x


def bench(out: Path, *extra: str) -> dict:
    res = subprocess.run(
        [sys.executable, "-m", "adaserve", "bench", "--target", str(DEMO / "target"), "--draft", str(DEMO / "draft"),
         "--clock", "simulated", "--device-profile", "a100-80g-tp4/llama-3.1-70b", "--policies",
         "incremental,adaserve,chain:2", "--duration", "1.5", "--max-tokens", "10", "--json", str(out), *extra],
        capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.skipif(not (DEMO / "target" / "config.json").is_file(), reason="demo pair not in this checkout")
def test_same_seed_same_report(tmp_path: Path) -> None:
    a = bench(tmp_path / "a.json", "--rps", "6")
    b = bench(tmp_path / "b.json", "--rps", "6")
    assert strip_wall_clock(a) == strip_wall_clock(b)
    assert a["clock"] == "simulated" and a["lossless"] is True  # every policy produced the target's tokens
    assert a["simulation"]["sched"] == "fixed" and a["simulation"]["sched_ms"] == 1.0
    for row in a["results"]:
        assert row["simulated"]["iterations"] > 0
        # a simulated run's time is the device's: at least one 24 ms target forward per iteration
        assert row["simulated"]["target_s"] >= 0.024 * row["simulated"]["iterations"]
        if row["policy"] == "adaserve":
            assert row["budget_use"]["iterations"] > 0 and row["budget_use"]["mean_budget"] >= a["budget"]


@pytest.mark.skipif(not (DEMO / "target" / "config.json").is_file(), reason="demo pair not in this checkout")
def test_urgent_share_sweep_reports_each_share(tmp_path: Path) -> None:
    rep = bench(tmp_path / "u.json", "--rps", "4", "--sweep", "urgent-share", "--values", "0.2,0.8")
    assert {r["x"] for r in rep["results"]} == {0.2, 0.8}
    for r in rep["results"]:
        assert r["mix"]["coding"] == pytest.approx(r["x"])
    assert set(rep["adaserve_vs_best_other"]) == {"0.2", "0.8"}


def test_urgent_mix_keeps_the_other_classes_proportions() -> None:
    mix = urgent_mix(0.5, {"coding": 0.6, "chat": 0.2, "summarization": 0.2})
    assert mix == pytest.approx({"coding": 0.5, "chat": 0.25, "summarization": 0.25})
    assert urgent_mix(1.0) == {"coding": 1.0}


def test_sweep_points_vary_one_thing() -> None:
    cfg = BenchConfig(target=DEMO, draft=DEMO, policies=("adaserve",), rates=(3.0,), sweep="slo-scale",
                      values=(0.5, 2.0), clock="simulated")
    pts = sweep_points(cfg, baseline_tpot_ms=20.0)
    assert [p.workload.slo_scale for p in pts] == [0.5, 2.0]
    assert {p.workload.rate for p in pts} == {3.0}
    paper = BenchConfig(target=DEMO, draft=DEMO, policies=("adaserve",), rates=(2.6,), duration_s=360.0,
                        slo_classes="paper", output_tokens=256, clock="simulated")
    (pt,) = sweep_points(paper, baseline_tpot_ms=30.0)
    assert pt.workload.fixed_output_tokens == 256
    assert {c.name: c.tpot_slo_ms(30.0) for c in pt.workload.classes} == {
        "coding": pytest.approx(36.0), "chat": 50.0, "summarization": 150.0}
    with pytest.raises(ValueError, match="slo_classes"):
        BenchConfig(target=DEMO, draft=DEMO, slo_classes="strict")
    with pytest.raises(ValueError, match="exactly one rate"):
        BenchConfig(target=DEMO, draft=DEMO, rates=(1.0, 2.0), sweep="slo-scale", values=(1.0,))
    with pytest.raises(ValueError, match="wall clock only"):
        BenchConfig(target=DEMO, draft=DEMO, policies=("hf",), clock="simulated")
    with pytest.raises(ValueError, match="clock"):
        BenchConfig(target=DEMO, draft=DEMO, clock="sundial")


@pytest.mark.skipif(not (DEMO / "target" / "config.json").is_file(), reason="demo pair not in this checkout")
def test_artifact_trace_on_the_artifact_profile(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The paper's workload format on the artifact's measured cost, end to end: per-class results, the file's
    sha256, fixed output lengths, and every policy still the target's own tokens."""
    prompts = {1.2: "def add(a, b):\n    \"\"\"Return the sum of a and b.\"\"\"\n",
               -50.0: "What does the json module do?",
               -150.0: "Please summarize the following document.\n\nimport os\nimport sys\n\ndef main():\n    pass\n"}
    rows = [{"emission_time_ms": 100.0 * i, "input_length": 10, "output_length": 6 + i % 3, "prompt": prompts[r],
             "slo_ratio": r} for i, r in enumerate([1.2, -50.0, -150.0, 1.2, -50.0, -150.0])]
    trace = tmp_path / "emission_tiny.json"
    trace.write_text(json.dumps(rows))
    out = tmp_path / "r.json"
    monkeypatch.setenv("ADASERVE_FEW_ROW_KERNELS", "off")  # no kernel timing: seconds, not minutes, on a cold cache
    code = main(["bench", "--model", "demo-tiny", "--clock", "simulated", "--device-profile", "artifact/llama-3.1-70b",
                 "--policies", "incremental,adaserve", "--trace-json", str(trace), "--json", str(out)])
    assert code == 0
    rep = json.loads(out.read_text())
    assert rep["lossless"] is True and rep["baseline_tpot_ms"] == 30.0
    info = rep["trace_json"]
    assert info["file"] == "emission_tiny.json" and info["sha256"] == hashlib.sha256(trace.read_bytes()).hexdigest()
    assert info["requests"] == 6 and info["window_s"] == 0.5 and info["outputs_capped"] == 0
    assert {k: v["tpot_slo_ms"] for k, v in info["classes"].items()} == {
        "coding": pytest.approx(36.0), "chat": 50.0, "summarization": 150.0}
    assert rep["simulation"]["device_profile"] == "artifact/llama-3.1-70b"
    for r in rep["results"]:
        assert r["requests"] == 6 and r["prompts_truncated"] == 0 and r["rate_rps"] == 12.0
        assert set(r["per_class"]) == {"coding", "chat", "summarization"}
        assert r["per_class"]["chat"]["tpot_slo_ms"] == 50.0
        # fixed lengths, EOS ignored: every output token of the trace was produced
        assert r["throughput_tok_s"] * r["wall_s"] == pytest.approx(sum(row["output_length"] for row in rows))
