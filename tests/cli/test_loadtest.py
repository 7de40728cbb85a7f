"""``adaserve loadtest --up``: starts the local stack, drives it over HTTP, prints a JSON report, stops it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.servers import ROOT, demo_pair


def test_loadtest_up_compares_with_a_plain_load_balancer_at_multiples_of_capacity(tmp_path: Path) -> None:
    """The structure of the report only: how many requests meet their targets depends on this machine's speed."""
    demo_pair()
    env = {**os.environ, "ADASERVE_TORCH_THREADS": "1"}
    out, plot = tmp_path / "report.json", tmp_path / "load.png"
    r = subprocess.run([sys.executable, "-m", "adaserve", "loadtest", "--up", "--target", "demo-tiny",
                        "--budget", "16", "--load", "0.5,2", "--probe-s", "3", "--probe-concurrency", "2",
                        "--compare", "--duration", "3", "--max-tokens", "24", "--mix", "coding=0.5,chat=0.5",
                        "--overhead", "2", "--json", str(out), "--plot", str(plot)],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    report = json.loads(r.stdout)
    assert report == json.loads(out.read_text())
    assert report["model"] == "demo" and {c["name"] for c in report["classes"]} >= {"coding", "chat"}
    cap = report["capacity"]
    assert cap["given"] is False and cap["throughput_tok_s"] > 0 and cap["capacity_rps"] > 0
    assert cap["url"] == report["systems"]["plain"]["url"]  # measured without admission control in the way
    config = report["config"]
    assert config["load"] == [0.5, 2.0] and config["command"].startswith("adaserve loadtest --up")
    assert config["worker"]["budget"] == 16 and config["worker"]["lone_tpot_ms"] > 0
    assert report["systems"]["adaserve"]["settings"]["admission"] == "slo"
    assert report["systems"]["plain"]["settings"] == {"routing": "least-loaded", "admission": "none",
                                                      "queue_timeout_s": 2.0}
    assert report["rates"] == report["systems"]["adaserve"]["rates"]
    for system in report["systems"].values():
        rows = system["rates"]
        assert [row["load"] for row in rows] == pytest.approx([0.5, 2.0])
        assert rows[1]["rate_rps"] == pytest.approx(2.0 * cap["capacity_rps"])
        for row in rows:
            assert row["failed"] == 0 and row["admitted"] + row["refused"] == row["requests"]
            assert set(row["per_class"]) <= {"coding", "chat"}
            for cls in row["per_class"].values():
                assert 0 <= cls["slo_attainment"] <= (cls["admitted_attainment"] or 0) <= 1 or not cls["admitted"]
    assert report["systems"]["plain"]["rates"][0]["refused"] == 0  # a plain load balancer refuses only when full
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
    r = subprocess.run([sys.executable, "-m", "adaserve", "loadtest", "--url", "http://x", "--compare"],
                       cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--compare-url" in r.stderr and "Traceback" not in r.stderr


def test_a_gateway_lost_during_the_run_is_a_cli_error_not_a_traceback(monkeypatch: pytest.MonkeyPatch) -> None:
    """The stack answered at first, then stopped (killed, crashed) while the rates ran: the fetch's transport error
    becomes the CLI's one-line error (exit 2), not httpx's traceback."""
    import argparse

    import httpx

    from adaserve.cli import loadtest
    from adaserve.cli_error import CliError

    async def lost(*_: object) -> dict:
        raise httpx.ConnectError("All connection attempts failed")

    monkeypatch.setattr(loadtest, "_measure", lost)
    with pytest.raises(CliError, match=r"lost the connection during the run \(http://127\.0\.0\.1:1.*All connection"):
        loadtest._run(argparse.Namespace(), "http://127.0.0.1:1", None, None)
