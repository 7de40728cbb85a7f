"""The micro-benchmarks: the engine's own cost (engine_only.py) and the race against transformers
(peer_compare.py), on the tiny demo pair; and ``adaserve microbench``'s one-line errors."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from adaserve.bench.engine_only import (
    IterationTimes,
    ScanClock,
    cell_stats,
    load_pair,
    run_engine_only,
    settings,
    summarize_cell,
)
from adaserve.bench.microbench_options import EngineOnlyConfig, PeerConfig
from adaserve.engine.model import native_kernels


def test_summary_shares_and_breakdown() -> None:
    its = [IterationTimes(step=0.10, target_fwd=0.06, draft_fwd=0.02, speculate=0.03, select=0.002, verify=0.065,
                          tokens=4, cpu_step=0.2, cpu_fwd=0.17),
           IterationTimes(step=0.30, target_fwd=0.20, draft_fwd=0.04, speculate=0.06, select=0.004, verify=0.22,
                          tokens=6, cpu_step=0.6, cpu_fwd=0.51)]
    s = summarize_cell(its)
    assert s["non_forward_share"] == pytest.approx((0.02 + 0.06) / 0.4)
    assert s["median_iteration_share"] == pytest.approx((0.2 + 0.2) / 2)
    assert s["non_forward_share_cpu"] == pytest.approx(1 - 0.68 / 0.8)
    assert s["speculate_other_ms"] == pytest.approx(1e3 * (0.01 + 0.02) / 2)
    assert s["verify_other_ms"] == pytest.approx(1e3 * (0.005 + 0.02) / 2)
    assert s["rest_ms"] == pytest.approx(1e3 * (0.003 + 0.016) / 2)
    assert s["tokens_per_s"] == pytest.approx(10 / 0.4)
    assert s["shapes"] == {"plain": 2}  # no shape recorded: plain decoding


def test_a_cell_names_the_shapes_chosen_and_their_predicted_price() -> None:
    """Why a policy drafted where plain decoding was faster: each shape's count, and the forwards the cost models
    expected against plain decoding's (issue 30's GPU run)."""
    its = [IterationTimes(step=0.010, target_fwd=0.004, draft_fwd=0.002, speculate=0.0, select=0.0, verify=0.0,
                          tokens=3, depth=d, width=w, predicted=p, predicted_plain=0.003)
           for d, w, p in [(4, 2, 0.007), (4, 2, 0.009), (0, 0, 0.003), (2, 1, 0.005)]]
    s = summarize_cell(its)
    assert s["shapes"] == {"2x1": 1, "4x2": 2, "plain": 1}
    assert s["predicted_iteration_ms"] == pytest.approx(6.0)
    assert s["predicted_plain_iteration_ms"] == pytest.approx(3.0)


@pytest.fixture(scope="module")
def demo() -> tuple:
    return load_pair("demo-tiny", "cpu", 64)


def test_engine_only_on_the_demo_pair(demo: tuple) -> None:
    target, draft, tok = demo
    cfg = EngineOnlyConfig(batches=(1, 3), modes=("spec", "plain", "chain"), steps=2, warmup_steps=1, repeats=2,
                           kv_memory_mb=64)
    env_before = os.environ.get(native_kernels.ENV)
    report = run_engine_only(target, draft, tok, cfg)
    cells = {(c["mode"], c["batch"]): c for c in report["cells"]}
    assert set(cells) == {(m, n) for m in ("spec", "plain", "chain") for n in (1, 3)}
    assert cells[("chain", 1)]["policy"] == "chain:4"
    for c in cells.values():  # CPU time per emitted token: a request's TPOT over the batch
        assert c["cpu_ms_per_token_min"] <= c["cpu_ms_per_token_median"] <= c["cpu_ms_per_token_max"]
        assert c["cpu_ms_per_token_median"] > 0
    for c in cells.values():
        assert len(c["repeats"]) == 2
        assert 0 <= c["non_forward_share_min"] <= c["non_forward_share_median"] <= c["non_forward_share_max"] < 1
        assert all(r["forward_ms"] > 0 and r["tokens_per_iteration"] >= c["batch"] for r in c["repeats"])
    assert all(r["speculate_other_ms"] == 0 for r in cells[("plain", 3)]["repeats"])  # no draft without speculation
    # the CPU kernels' vocabulary scans (ScanClock), where they serve: the picks and the argmax, part of the time
    # outside the forwards, split off beside it
    serving = native_kernels.chosen() is not None
    for c in cells.values():
        for r in c["repeats"]:
            assert r["non_forward_less_scans_ms"] == pytest.approx(r["non_forward_ms"] - r["vocab_scan_ms"])
            assert (r["vocab_scan_ms"] > 0) == serving
            assert r["vocab_scan_ms"] < r["non_forward_ms"]
    # the shapes chosen, counted over the timed iterations of every repeat, and what the cost models priced: plain
    # decoding's own iterations at plain decoding's price, a chain of 4 above it (4 draft steps and 5 tokens)
    for c in cells.values():
        assert sum(c["shapes"].values()) == 2 * 2
        assert c["predicted_plain_iteration_ms_median"] > 0
    for n in (1, 3):
        plain_cell, chain = cells[("plain", n)], cells[("chain", n)]
        assert plain_cell["shapes"] == {"plain": 4}
        assert plain_cell["predicted_iteration_ms_median"] == plain_cell["predicted_plain_iteration_ms_median"]
        assert chain["shapes"] == {"4x1": 4}
        assert chain["predicted_iteration_ms_median"] > chain["predicted_plain_iteration_ms_median"]
    # host-device crossings, counted in their own iterations (issue 30): no synchronize anywhere; each forward
    # sends its inputs in one non-blocking copy; plain decoding waits once (the draws of the walk), speculation
    # once more (the whole candidate tree, its beam levels having stayed on the device)
    plain, spec = cells[("plain", 1)], cells[("spec", 1)]
    assert plain["blocking_per_iteration"] == plain["d2h_per_iteration"] == 1
    assert plain["async_copy_per_iteration"] == 1
    assert spec["blocking_per_iteration"] == spec["d2h_per_iteration"] == 2
    for c in cells.values():
        assert c["sync_per_iteration"] == c["h2d_per_iteration"] == c["data_shape_per_iteration"] == 0
        where = c["repeats"][0]["where_per_iteration"]
        assert any(w.startswith("async_copy Tensor.to at engine/model/staging.py") for w in where), where
    # device operations (a kernel launch each on a GPU): the forwards hold most; speculation's levels add their picks
    # outside them, plain decoding only the walk's few
    for c in cells.values():
        assert c["ops_inside_forwards_per_iteration"] > c["ops_outside_forwards_per_iteration"] > 0
        assert sum(c["repeats"][0]["ops_outside_by_name_per_iteration"].values()) <= \
            c["repeats"][0]["ops_outside_forwards_per_iteration"]
    assert spec["ops_outside_forwards_per_iteration"] > plain["ops_outside_forwards_per_iteration"]
    # counted as a GPU launches them (engine_only.torch_picks), though the timed iterations took the CPU kernels
    assert "topk" in spec["repeats"][0]["ops_outside_by_name_per_iteration"]
    assert os.environ.get(native_kernels.ENV) == env_before  # restored after the counted iterations


def test_host_cost_reaches_the_engine(demo: tuple, monkeypatch: pytest.MonkeyPatch) -> None:
    """``--host-cost``: the cell's engine prices its host time (EngineConfig.host_cost), and the report says so."""
    from adaserve.bench import engine_only
    from adaserve.bench.microbench_options import add_common, add_engine_only, engine_only_config

    p = argparse.ArgumentParser()
    add_common(p)
    add_engine_only(p)
    assert engine_only_config(p.parse_args(["--host-cost"])).host_cost is True
    assert engine_only_config(p.parse_args([])).host_cost is False
    made: list[bool] = []

    class Spy(engine_only.Engine):
        def __init__(self, *args: object, **kwargs: object) -> None:
            super().__init__(*args, **kwargs)  # type: ignore[arg-type]
            made.append(self.cfg.host_cost)

    monkeypatch.setattr(engine_only, "Engine", Spy)
    target, draft, tok = demo
    for on in (True, False):
        cfg = EngineOnlyConfig(batches=(1,), modes=("spec",), steps=1, warmup_steps=0, count_steps=0, repeats=1,
                               kv_memory_mb=64, host_cost=on)
        run_engine_only(target, draft, tok, cfg)
        assert settings(target, cfg, model="demo-tiny", device="cpu")["host_cost"] is on
    assert made == [True, False]


def test_profiled_cells_run_the_engine_as_served(demo: tuple, monkeypatch: pytest.MonkeyPatch) -> None:
    """``--profiled``: the cells' engines take the budget, cost models and tree bounds that ``build_engine`` gives a
    served engine from the pair's start-up profile, not the flat guess and ``--budget``."""
    from adaserve.bench import engine_only
    from adaserve.engine.config import EngineConfig

    target, draft, tok = demo
    served = engine_only.served_config(target, draft, "demo-tiny")
    assert served.target_cost is not None and served.draft_cost is not None
    made: list[EngineConfig] = []

    class Spy(engine_only.Engine):
        def __init__(self, *args: object, **kwargs: object) -> None:
            super().__init__(*args, **kwargs)  # type: ignore[arg-type]
            made.append(self.cfg)

    monkeypatch.setattr(engine_only, "Engine", Spy)
    cfg = EngineOnlyConfig(batches=(1,), modes=("spec",), steps=1, warmup_steps=0, count_steps=0, repeats=1,
                           kv_memory_mb=64, budget=7, host_cost=True)
    run_engine_only(target, draft, tok, cfg, served=served)
    run_engine_only(target, draft, tok, cfg)
    as_served, unprofiled = made
    assert (as_served.budget, as_served.adaptive) == (served.budget, served.adaptive) and as_served.budget != 7
    assert as_served.target_cost == served.target_cost and as_served.draft_cost == served.draft_cost
    assert as_served.host_cost and as_served.policy == "adaserve"
    assert unprofiled.budget == 7 and unprofiled.target_cost is None and unprofiled.draft_cost is None


def test_a_runner_names_the_captures_that_ran_out_of_memory(target_dir: Path, draft_dir: Path) -> None:
    """What the microbench reports per model (``capture_failures``): a GPU run's figures read slower where a shape's
    graph could not be captured. A copy: the caller cannot change the record."""
    from tests.engine.helpers import runner

    target, draft = runner(target_dir, static_shapes=True), runner(draft_dir)
    assert target.static is not None and target.capture_failures == [] == draft.capture_failures
    target.static.capture_failures.append("bucket (1, 8, 64): CUDA out of memory")
    got = target.capture_failures
    assert got == ["bucket (1, 8, 64): CUDA out of memory"]
    got.clear()
    assert target.capture_failures == ["bucket (1, 8, 64): CUDA out of memory"]


def test_the_report_says_which_picks_the_timed_iterations_took(demo: tuple, monkeypatch: pytest.MonkeyPatch) -> None:
    """The CPU's kernels or the torch picks a GPU runs shape a CPU's figures: the settings record the switch, and the
    attention the float target takes with it (the kernels' attend.c where they build, else SDPA)."""
    cfg = EngineOnlyConfig(batches=(1,), modes=("spec",), steps=1, warmup_steps=0, repeats=1, kv_memory_mb=64)
    monkeypatch.delenv(native_kernels.ENV, raising=False)
    got = settings(demo[0], cfg, model="demo-tiny", device="cpu")
    lib = native_kernels.kernels()
    assert got[native_kernels.ENV] == "auto" and got["attention_kernels"] == ("sdpa" if lib is None else lib.path.stem)
    monkeypatch.setenv(native_kernels.ENV, "off")
    got = settings(demo[0], cfg, model="demo-tiny", device="cpu")
    assert got[native_kernels.ENV] == "off" and got["attention_kernels"] == "sdpa"


def test_peer_race_on_the_demo_pair(demo: tuple) -> None:
    from adaserve.bench.hf_peer import HFPeer
    from adaserve.bench.peer_compare import run_peer, verdict
    from adaserve.engine.loading.catalog import resolve

    target, draft, tok = demo
    pair = resolve("demo-tiny", progress=False)
    hf = HFPeer(pair.target, pair.draft, eos_token_id=target.model.cfg.eos_token_ids[0], pad_token_id=0)
    cfg = PeerConfig(concurrency=3, max_tokens=6, min_tokens=3, repeats=1, prompt_tokens=32, kv_memory_mb=64)
    report = run_peer(target, draft, hf, tok, cfg)
    single, conc = report["single"], report["concurrent"]
    assert single["variants"] == ["engine-adaserve", "engine-incremental", "hf", "hf-static", "hf-assisted"]
    assert conc["variants"] == ["engine-adaserve", "engine-incremental", "hf", "hf-static"]
    for run in (single["repeats"][0], conc["repeats"][0]):
        assert run["engine-adaserve"]["outputs_equal_reference"] == 1.0  # speculation is lossless
        assert 0 < run["engine-adaserve"]["non_forward_share"] < 1
        assert all(r["throughput_tok_s"] > 0 and r["output_tokens"] > 0 for r in run.values())
    assert len(conc["caps"]) == 3 and all(3 <= c <= 6 for c in conc["caps"])
    costs = report["forward_cpu_ms_by_tokens"]
    assert set(costs) == {"target", "draft", "target_plain_linear", "draft_plain_linear"}
    assert set(costs["target"]) == {"1", "2", "3", "5", "9", "17"}
    v = verdict(report)
    assert v["single_no_worse"] == (v["single_tpot_engine_over_hf"] <= 1.0)
    assert v["single_cpu_per_token_engine_over_hf"] > 0 and v["concurrent_tokens_per_cpu_s_engine_over_hf"] > 0


def test_peer_loads_where_and_as_the_engine_computes() -> None:
    """transformers gets the engine's device and dtype (a GPU run once left it on the host CPU in fp32)."""
    import torch

    from adaserve.bench.hf_peer import HFPeer
    from adaserve.engine.loading.catalog import resolve

    pair = resolve("demo-tiny", progress=False)
    hf = HFPeer(pair.target, pair.draft, eos_token_id=1, pad_token_id=0, device="cpu", dtype=torch.bfloat16)
    assert hf.model.dtype == torch.bfloat16 and hf.model.device.type == "cpu"
    assert hf.draft is not None and hf.draft.dtype == torch.bfloat16


@pytest.mark.parametrize("args", [["--batches", "0"], ["--modes", "fast"], ["--peer", "--min-tokens", "9",
                                                                             "--max-tokens", "4"],
                                  ["--peer", "--weights", "int4"]])
def test_bad_settings_are_one_line_errors(args: list[str]) -> None:
    res = subprocess.run([sys.executable, "-m", "adaserve", "microbench", "--model", "demo-tiny", *args],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 2
    assert res.stderr.startswith("adaserve: error:") and len(res.stderr.strip().splitlines()) == 1


def test_before_after_combines_single_cell_runs() -> None:
    from adaserve.bench.engine_only import before_after

    def run(share: float, mode: str = "spec", batch: int = 16) -> dict:
        rep = {"non_forward_share": share, "non_forward_share_cpu": share, "iteration_ms": 100.0,
               "non_forward_ms": 100 * share}
        return {"config": {"model": "m", "batches": [batch]}, "cells": [{"mode": mode, "batch": batch,
                                                                          "repeats": [rep]}]}

    out = before_after([run(0.06), run(0.08), run(0.01, "plain", 1)], [run(0.04), run(0.02), run(0.05)])
    assert [(r["mode"], r["batch"]) for r in out["table"]] == [("spec", 16)]  # plain 1 was not run after
    row = out["table"][0]
    assert row["before"]["non_forward_share_median"] == pytest.approx(0.07)
    assert row["after"]["non_forward_share_min"] == 0.02 and row["after"]["repeats"] == 3
    assert out["before"]["config"] == {"model": "m"}  # only the settings every run shared


def test_cells_report_non_forward_cpu_ms_with_spread() -> None:
    from adaserve.bench.engine_only import IterationTimes, cell_stats, summarize_cell

    # 10 ms steps, 6 ms of them in forwards by the wall clock; by CPU time 8 ms steps with 6 ms of forwards
    its = [IterationTimes(step=0.010, target_fwd=0.005, draft_fwd=0.001, speculate=0.0, select=0.0, verify=0.0,
                          tokens=1, cpu_step=0.008 + k * 0.001, cpu_fwd=0.006) for k in range(3)]
    rep = summarize_cell(its)
    assert rep["non_forward_ms"] == pytest.approx(4.0)
    assert rep["non_forward_cpu_ms"] == pytest.approx(3.0)  # (2 + 3 + 4) / 3
    cell = cell_stats({("spec", 1): [rep, {**rep, "non_forward_cpu_ms": 5.0}, {**rep, "non_forward_cpu_ms": 1.0}]})[0]
    assert (cell["non_forward_cpu_ms_min"], cell["non_forward_cpu_ms_median"], cell["non_forward_cpu_ms_max"]) == (
        1.0, pytest.approx(3.0), 5.0)


def test_the_cells_load_the_weights_asked_for(tmp_path: Path) -> None:
    """``--weights``: the cells' models as quant.py serves them (int4 here: the precision ``adaserve up`` serves a GGUF
    model at on a CPU), named in the report's settings beside what the target's linears turned out to be; float, the
    issue-30 figures' setting, stays the default."""
    out = {}
    for weights in ("int4", None):
        path = tmp_path / f"{weights}.json"
        res = subprocess.run([sys.executable, "-m", "adaserve", "microbench", "--model", "demo-tiny", "--batches", "1",
                              "--modes", "plain", "--steps", "1", "--warmup", "0", "--count-steps", "0",
                              "--repeats", "1", "--prompt-tokens", "16", "--json", str(path),
                              *(["--weights", weights] if weights else [])],
                             capture_output=True, text=True, timeout=300)
        assert res.returncode == 0, res.stderr
        out[weights] = json.loads(path.read_text())["config"]
    assert out["int4"]["weights"] == "int4" and out["int4"]["served_weights"].startswith("int4")
    assert out[None]["weights"] == "float" and out[None]["served_weights"] == "float"


def test_the_scan_clock_times_the_kernels_own_calls_and_puts_them_back() -> None:
    from adaserve.engine.speculation.verify import first_argmax

    kernels = native_kernels.kernels()
    if kernels is None:
        pytest.skip("the CPU kernels do not build on this machine")
    found = kernels.lib.first_argmax
    rows = torch.randn(64, 4096)
    clock = ScanClock(kernels)
    assert kernels.lib.first_argmax is not found
    want = rows.argmax(-1)
    assert torch.equal(first_argmax(rows), want)  # the timed function answers as the library's own
    assert clock.calls == 1 and clock.seconds > 0
    clock.remove()
    assert kernels.lib.first_argmax is found
    first_argmax(rows)
    assert clock.calls == 1  # no longer counted


def test_a_cell_splits_off_the_vocabulary_scans() -> None:
    # 10 ms steps, 6 ms in forwards, 1.5 ms of the other 4 in the kernels' scans
    its = [IterationTimes(step=0.010, target_fwd=0.005, draft_fwd=0.001, speculate=0.0, select=0.0, verify=0.0,
                          tokens=1, scans=0.0015) for _ in range(2)]
    rep = summarize_cell(its)
    assert rep["vocab_scan_ms"] == pytest.approx(1.5)
    assert rep["non_forward_less_scans_ms"] == pytest.approx(2.5)
    cell = cell_stats({("spec", 32): [rep, {**rep, "non_forward_less_scans_ms": 3.5}]})[0]
    assert cell["vocab_scan_ms_median"] == pytest.approx(1.5)
    assert (cell["non_forward_less_scans_ms_min"], cell["non_forward_less_scans_ms_max"]) == (
        pytest.approx(2.5), pytest.approx(3.5))
