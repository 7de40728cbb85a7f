"""``adaserve loadtest --up``: starts the local stack, drives it over HTTP, prints a JSON report, stops it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.servers import ROOT, demo_pair


def test_loadtest_up_reports_attainment_per_class_and_the_gateway_overhead(tmp_path: Path) -> None:
    demo_pair()
    env = {**os.environ, "ADASERVE_TORCH_THREADS": "1"}
    out, plot = tmp_path / "report.json", tmp_path / "load.png"
    r = subprocess.run([sys.executable, "-m", "adaserve", "loadtest", "--up", "--target", "demo-tiny",
                        "--budget", "16", "--rps", "2",
                        "--duration", "4", "--max-tokens", "24", "--mix", "coding=0.5,chat=0.5", "--overhead", "2",
                        "--json", str(out), "--plot", str(plot)],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    report = json.loads(r.stdout)
    assert report == json.loads(out.read_text())
    assert report["model"] == "demo" and {c["name"] for c in report["classes"]} >= {"coding", "chat"}
    (row,) = report["rates"]
    assert row["requests"] >= 1 and row["failed"] == 0 and row["refused"] == 0
    assert set(row["per_class"]) <= {"coding", "chat"}
    assert row["throughput_tok_s"] > 0 and row["mean_tpot_ms"] > 0
    for key in ("ttft_ms", "tpot_ms"):
        assert report["overhead"][key]["direct"] > 0 and report["overhead"][key]["gateway"] > 0
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "Traceback" not in r.stderr


def test_loadtest_unreachable_gateway_is_one_line_and_exit_2() -> None:
    r = subprocess.run([sys.executable, "-m", "adaserve", "loadtest", "--url", "http://127.0.0.1:9"], cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and r.stderr.strip().startswith("adaserve: error: cannot reach the gateway")
    r = subprocess.run([sys.executable, "-m", "adaserve", "loadtest", "--url", "http://x", "--overhead", "3"],
                       cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--worker-url" in r.stderr
