"""Device models: the roofline's shape, the measured table's interpolation, the shipped profiles."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest

from adaserve.bench.sim.device_model import (
    Hardware,
    ModelShape,
    Roofline,
    Table,
    builtin_profiles,
    load_profile_file,
    profile_from_measured,
)
from adaserve.bench.sim.profile import simulated_profile

HW = Hardware("toy", hbm_bytes_per_s=1e12, flops_per_s=100e12, mem_efficiency=1.0, compute_efficiency=1.0,
              fixed_s=1e-3, link_bytes_per_s=100e9, allreduce_latency_s=5e-6)
TOY = ModelShape("toy-1b", params=1e9, layers=10, hidden=1024, kv_heads=2, head_dim=64)


def test_roofline_is_flat_while_memory_bound_then_linear_in_tokens() -> None:
    r = Roofline(HW, TOY)
    t_mem = 2e9 / 1e12  # 2 GB of bf16 weights at 1 TB/s
    assert r.seconds(1, 0) == pytest.approx(1e-3 + t_mem)
    ridge = int(t_mem / (2e9 / 100e12))  # 2 GFLOP per token at 100 TFLOP/s: 100 tokens
    assert r.seconds(ridge // 2, 0) == pytest.approx(r.seconds(1, 0))
    assert r.seconds(4 * ridge, 0) == pytest.approx(1e-3 + 4 * ridge * 2e9 / 100e12)
    # every context token adds its K and V of every layer to the bytes read
    assert r.seconds(1, 1000) - r.seconds(1, 0) == pytest.approx(1000 * 2 * 10 * 2 * 64 * 2 / 1e12)


def test_tensor_parallelism_splits_the_work_and_pays_two_all_reduces_per_layer() -> None:
    one, four = Roofline(HW, TOY, tp=1), Roofline(HW, TOY, tp=4)
    comm_floor = 2 * TOY.layers * HW.allreduce_latency_s
    assert four.seconds(1, 0) == pytest.approx(1e-3 + 2e9 / 4 / 1e12 + comm_floor, rel=1e-3)
    assert four.seconds(1, 0) < one.seconds(1, 0)


def test_measured_table_interpolates_and_prices_extra_context() -> None:
    t = Table((1, 2, 4), (0.010, 0.012, 0.020), context_per_sequence=100, alpha=1e-6)
    assert t.seconds(1, 100) == pytest.approx(0.010)
    assert t.seconds(3, 300) == pytest.approx(0.016)
    assert t.seconds(8, 800) == pytest.approx(0.036)  # past the last point: the last slope
    assert t.seconds(1, 1100) == pytest.approx(0.011)  # 1000 tokens beyond the reference context
    with pytest.raises(ValueError, match="increasing"):
        Table((2, 1), (0.1, 0.2), context_per_sequence=1, alpha=0.0)


def test_shipped_profiles_load_and_their_knee_matches_the_papers_order_of_magnitude() -> None:
    names = set(builtin_profiles())
    assert {"a100-80g-tp4/llama-3.1-70b", "h100-80g/llama-3.1-8b", "a100-80g-tp2/qwen2.5-32b"} <= names
    paper = load_profile_file("a100-80g-tp4/llama-3.1-70b")
    data = simulated_profile(paper)
    # AdaServe Table 1: B = 156 on an A100; the knee rule on the power-of-two grid lands on 128
    assert 64 <= data["target"]["budget"] <= 256
    ratio = paper.target.seconds(1, 0) / paper.draft.seconds(1, 0)
    assert ratio > 8  # a 1B draft step is a small fraction of a 70B forward over 4 GPUs


def test_a_shipped_measured_profile_prices_as_its_table() -> None:
    """h200/llama-3.1-8b is the profiler's own output (kind "measured"): at the reference context the price is
    the measured row, and more context costs alpha a token."""
    prof = load_profile_file("h200/llama-3.1-8b")
    part = prof.source["target"]
    row = part["table"][0]
    ref = part["context"]  # n = 1: one sequence of ``context`` cached tokens
    assert prof.target.seconds(row["n_tokens"], ref) == pytest.approx(row["latency_ms"] / 1e3)
    alpha = part["cost_model"]["alpha"]
    assert prof.target.seconds(1, ref + 1000) == pytest.approx(row["latency_ms"] / 1e3 + 1000 * alpha)
    assert prof.target.seconds(1, ref) > 2 * prof.draft.seconds(1, ref)  # an 8B forward against a 1B one


def test_bad_profiles_are_refused_with_a_message(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown device profile"):
        load_profile_file("no-such-gpu/model")
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"name": "x", "sched_ms": 1, "hardware": [], "target": {}, "draft": {}}))
    with pytest.raises(ValueError, match="bad or missing field"):
        load_profile_file(str(bad))
    bad.write_text("not json")
    with pytest.raises(ValueError, match="JSON"):
        load_profile_file(str(bad))


def test_measured_profile_needs_the_draft_table() -> None:
    part = {"table": [{"n_tokens": 1, "latency_ms": 5.0}, {"n_tokens": 2, "latency_ms": 6.0}], "context": 64,
            "cost_model": {"alpha": 0.0, "gamma": 0.001, "delta": 0.004}}
    prof = profile_from_measured({"target": part, "draft": part}, sched_s=0.001)
    assert prof.target.seconds(1, 64) == pytest.approx(0.005)
    assert prof.unloaded_tpot_s(64) == pytest.approx(0.006)
    with pytest.raises(ValueError, match="draft"):
        profile_from_measured({"target": part}, sched_s=0.0)


# The AdaServe artifact's batch-to-latency table for Llama-3.1-70B (exps/test.sh), n = 1 from its baseline latency
ARTIFACT_TABLE_MS = {1: 30.0, 128: 55.0, 256: 85.0, 512: 125.0, 1024: 205.0}


def test_artifact_profile_reproduces_its_table_and_the_papers_draft_step() -> None:
    prof = load_profile_file("artifact/llama-3.1-70b")
    assert prof.name == "artifact/llama-3.1-70b" and "artifact/llama-3.1-70b" in builtin_profiles()
    for n, ms in ARTIFACT_TABLE_MS.items():
        assert 1e3 * prof.target.seconds(n, 0) == pytest.approx(ms)
        assert 1e3 * prof.target.seconds(n, 100_000) == pytest.approx(ms)  # the table has no context cost
    assert 1e3 * prof.target.seconds(64, 0) == pytest.approx(30 + 63 * 25 / 127)  # linear between 1 and 128
    ts = [prof.target.seconds(n, 0) for n in range(1, 2049)]
    assert all(b >= a for a, b in itertools.pairwise(ts))  # monotone in n, past the table's end too
    assert 1e3 * prof.draft.seconds(1, 0) == pytest.approx(5.0, abs=0.1)  # paper 6.3: ~5 ms per step
    assert 1e3 * prof.draft.seconds(96, 0) == pytest.approx(5.0, abs=0.1)  # the artifact's largest draft step
    assert prof.sched_s == 0.0  # the 30 ms baseline is the whole system's per-token latency
    assert prof.unloaded_tpot_s(0) == pytest.approx(0.030)
    assert simulated_profile(prof)["target"]["budget"] == 128  # the knee rule on the table (README)


def test_a_profile_part_may_be_a_table_and_other_kinds_are_refused(tmp_path: Path) -> None:
    part = {"kind": "table", "latency_ms": [[1, 10.0], [64, 20.0]], "context_ms_per_token": 0.001}
    f = tmp_path / "t.json"
    f.write_text(json.dumps({"name": "t", "sched_ms": 0, "target": part, "draft": {**part, "latency_ms": [[1, 1.0],
                                                                                                      [8, 2.0]]}}))
    prof = load_profile_file(str(f))
    assert prof.target.seconds(1, 1000) == pytest.approx(0.011)  # 10 ms + 1000 context tokens at 1 us
    assert prof.draft.seconds(8, 0) == pytest.approx(0.002)
    f.write_text(json.dumps({"name": "t", "sched_ms": 0, "target": {**part, "kind": "abacus"}, "draft": part}))
    with pytest.raises(ValueError, match="abacus"):
        load_profile_file(str(f))
