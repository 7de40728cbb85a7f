"""Random-weight architectures (bench/random_arch.py): the GPU checklist's forward times and measured profiles,
run here on a tiny architecture through the same functions."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from adaserve.bench.random_arch import (
    ARCHITECTURES,
    DecodeProbe,
    SearchProbe,
    architecture,
    decode_times,
    main,
    profile_pair,
    random_model,
    runner_for,
    search_times,
)
from adaserve.bench.sim.device_model import profile_from_measured
from adaserve.engine.cost.profiler import ProfilerConfig

TINY = {**ARCHITECTURES["smollm2-135m"], "num_hidden_layers": 2, "hidden_size": 32, "intermediate_size": 64,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "vocab_size": 120,
        "max_position_embeddings": 256}


def test_published_architectures_parse() -> None:
    cfg = architecture("llama-3.1-8b")
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_kv_heads, cfg.rope_type) == (32, 4096, 8, "llama3")
    with pytest.raises(ValueError, match="unknown architecture"):
        architecture("gpt-5")


def test_random_model_is_tied_normed_and_deterministic() -> None:
    a = random_model(TINY, device=torch.device("cpu"), dtype=torch.float32, seed=0)
    b = random_model(TINY, device=torch.device("cpu"), dtype=torch.float32, seed=0)
    assert a.lm_head.weight is a.model.embed_tokens.weight
    assert torch.equal(a.model.norm.weight, torch.ones(32))
    assert torch.equal(a.model.layers[1].mlp.down_proj.weight, b.model.layers[1].mlp.down_proj.weight)
    assert 0.015 < float(a.model.layers[0].mlp.up_proj.weight.std()) < 0.025


@pytest.mark.parametrize("static", [False, True])
def test_decode_times_report_one_forward(static: bool) -> None:
    r = runner_for(random_model(TINY, device=torch.device("cpu"), dtype=torch.float32), kv_bytes=2**22,
                   static_shapes=static)
    free = r.cache.free_pages
    out = decode_times(r, DecodeProbe(batch=3, new=2, context=10), repeats=3, warmup=1)
    assert out["static_shapes"] is static and out["min_ms"] <= out["median_ms"] <= out["p90_ms"]
    # the model's part (its own timer) inside the whole, the host's around it
    assert 0 < out["device_median_ms"] <= out["median_ms"] and out["host_median_ms"] > 0
    assert r.cache.free_pages == free  # the probe's sequences gave their pages back
    assert out["capture_failures"] == 0


def test_a_row_counts_the_captures_that_ran_out_of_memory_while_it_ran(monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.engine.helpers import captures_run_out_of_memory

    """A static row whose shapes could not be captured timed eager forwards: the row says how many captures failed
    while it ran (``capture`` stands in for CUDA's, raising what the allocator raises; no GPU here)."""
    r = runner_for(random_model(TINY, device=torch.device("cpu"), dtype=torch.float32), kv_bytes=2**22,
                   static_shapes=True)
    assert r.static is not None
    captures_run_out_of_memory(r.static, monkeypatch)
    first = decode_times(r, DecodeProbe(batch=3, new=2, context=10), repeats=2, warmup=1)
    again = decode_times(r, DecodeProbe(batch=3, new=2, context=10), repeats=2, warmup=1)
    assert first["capture_failures"] >= 1 and again["capture_failures"] == 0  # each shape tried once


def test_profile_pair_is_a_device_profile(tmp_path: Path) -> None:
    cpu = torch.device("cpu")
    t = runner_for(random_model(TINY, device=cpu, dtype=torch.float32), kv_bytes=2**23, static_shapes=True)
    d = runner_for(random_model(TINY, device=cpu, dtype=torch.float32, seed=1), kv_bytes=2**23, static_shapes=True)
    data = profile_pair(t, d, ProfilerConfig(max_tokens=4, context=16, fit_contexts=(8, 16), repeats=1),
                        progress=False)
    assert [row["n_tokens"] for row in data["target"]["table"]] == [1, 2, 4]
    prof = profile_from_measured(data, sched_s=0.001)
    assert prof.target.seconds(1, 0) > 0 and prof.draft.seconds(4, 16) > 0


def test_command_line_writes_forward_times(tmp_path: Path) -> None:
    cfg = tmp_path / "tiny.json"
    cfg.write_text(json.dumps(TINY))
    out = tmp_path / "f.json"
    assert main(["forwards", "--device", "cpu", "--target", str(cfg), "--draft", str(cfg), "--batches", "1,2",
                 "--repeats", "1", "--kv-gib", "0.01", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["forwards"]
    assert {(r["model"], r["batch"], r["static_shapes"]) for r in rows} == {
        (m, b, s) for m in ("target", "draft") for b in (1, 2) for s in (False, True)}


@pytest.mark.parametrize("path", ["eager", "static", "static-steps"])
def test_search_times_report_one_search_and_its_steps(path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A draft search as the engine runs it: with static shapes and the torch picks (a GPU's path) its levels run
    as the draft's steps; the search is undone after each repeat, so every one starts from the same context."""
    from tests.engine.helpers import use_cpu_kernels

    if path == "static-steps":
        use_cpu_kernels("torch", monkeypatch)
    r = runner_for(random_model(TINY, device=torch.device("cpu"), dtype=torch.float32), kv_bytes=2**22,
                   static_shapes=path != "eager")
    free = r.cache.free_pages
    out = search_times(r, SearchProbe(batch=3, depth=3, width=2, context=10), repeats=3, warmup=1)
    assert out["steps"] is (path == "static-steps") and out["static_shapes"] is (path != "eager")
    assert out["search_min_ms"] <= out["search_median_ms"] <= out["search_p90_ms"]
    assert out["step_median_ms"] == pytest.approx(out["search_median_ms"] / 3)
    assert 0 < out["device_median_ms"] <= out["search_median_ms"] and out["host_median_ms"] > 0
    assert r.cache.free_pages == free  # the probe's sequences gave their pages back


def test_command_line_writes_search_times(tmp_path: Path) -> None:
    cfg = tmp_path / "tiny.json"
    cfg.write_text(json.dumps(TINY))
    out = tmp_path / "s.json"
    assert main(["searches", "--device", "cpu", "--draft", str(cfg), "--batches", "1,2", "--shapes", "2x2,1x1",
                 "--repeats", "1", "--kv-gib", "0.01", "--context", "12", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["searches"]
    assert {(r["batch"], r["depth"], r["width"], r["static_shapes"]) for r in rows} == {
        (b, d, w, s) for b in (1, 2) for d, w in ((2, 2), (1, 1)) for s in (False, True)}
    with pytest.raises(SystemExit):
        main(["searches", "--device", "cpu", "--draft", str(cfg), "--shapes", "4x0", "--json", str(out)])
