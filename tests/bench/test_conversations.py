"""bench/conversations.py: the multi-turn report (affinity, TTFT per turn) and the gateway's prefix counters."""

from __future__ import annotations

import subprocess
import sys

import pytest

from adaserve.bench.conversations import TurnResult, affinity_report, prefix_between, prefix_counters
from tests.servers import ROOT


def turn(conv: str, k: int, worker: str | None, ttft: float | None = 10.0, finish: str = "length") -> TurnResult:
    return TurnResult(conv, k, worker, ttft, 8, finish, 100 * k)


def test_affinity_counts_later_turns_on_their_previous_turns_worker() -> None:
    turns = [turn("a", 1, "w-a", 100.0), turn("a", 2, "w-a", 20.0), turn("a", 3, "w-b", 30.0),
             turn("b", 1, "w-b", 300.0), turn("b", 2, "w-b", 40.0),
             turn("c", 1, None, None, "refused"),  # its conversation ends there: nothing to follow
             turn("d", 1, "w-a", 200.0), turn("d", 2, None, None, "error")]
    r = affinity_report(turns)
    assert (r["later_turns"], r["followed"]) == (3, 2) and r["affinity"] == pytest.approx(2 / 3)
    assert r["ttft_ms"]["1"] == {"served": 3, "median": 200.0, "p90": 300.0}
    assert r["ttft_ms"]["2"]["served"] == 2 and r["ttft_ms"]["2"]["median"] == pytest.approx(30.0)
    assert r["workers"] == {"w-a": 3, "w-b": 3} and r["unserved"] == {"refused": 1, "error": 1}
    assert affinity_report([turn("a", 1, "w-a")])["affinity"] is None


METRICS = """# HELP adaserve_gateway_prefix_requests_total x
# TYPE adaserve_gateway_prefix_requests_total counter
adaserve_gateway_prefix_requests_total{{result="hit"}} {hit}
adaserve_gateway_prefix_requests_total{{result="miss"}} {miss}
adaserve_gateway_prefix_requests_total{{result="no_headroom"}} 0.0
# HELP adaserve_gateway_prefix_routed_total x
# TYPE adaserve_gateway_prefix_routed_total counter
adaserve_gateway_prefix_routed_total {routed}
# HELP adaserve_gateway_prefix_blocks_total x
# TYPE adaserve_gateway_prefix_blocks_total counter
adaserve_gateway_prefix_blocks_total{{what="sent"}} {sent}
adaserve_gateway_prefix_blocks_total{{what="matched"}} {matched}
"""


def test_prefix_counters_between_two_scrapes() -> None:
    before = METRICS.format(hit=1, miss=2, routed=0, sent=10, matched=4)
    after = METRICS.format(hit=7, miss=4, routed=3, sent=110, matched=84)
    assert prefix_counters(before)["blocks_sent"] == 10
    d = prefix_between(before, after)
    assert (d["requests_hit"], d["requests_miss"], d["requests_no_headroom"], d["routed"]) == (6, 2, 0, 3)
    assert d["hit_rate_requests"] == pytest.approx(6 / 8) and d["hit_rate_blocks"] == pytest.approx(80 / 100)
    assert prefix_between("", "") == {}  # a gateway without the counters


def test_bad_conversation_options_are_one_line_and_exit_2() -> None:
    r = subprocess.run([sys.executable, "-m", "adaserve", "loadtest", "--url", "http://127.0.0.1:9",
                        "--conversations", "2", "--turns", "0"], cwd=ROOT, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 2 and r.stderr.strip().startswith("adaserve: error: --conversations: turns must be")
    assert "Traceback" not in r.stderr
