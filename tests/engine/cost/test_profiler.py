"""Start-up profiling on real forwards: a table, a budget on the grid, a fitted cost model, a cache."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from adaserve.engine.cost.budget import TableCheck
from adaserve.engine.cost.cost_model import CostModel
from adaserve.engine.cost.profile_cache import ProfileCache
from adaserve.engine.cost.profiler import (
    ProfilerConfig,
    forward_timer,
    model_identity,
    probe_grid,
    probe_plan,
    probe_split,
    profile_models,
    summarise_timings,
)
from adaserve.engine.model.runner import chunk_cells
from adaserve.engine.speculation.adaptive import speculation_floor
from tests.engine.helpers import runner

FAST = ProfilerConfig(max_tokens=32, context=32, fit_contexts=(8, 32), repeats=2, warmup=1)
# 0.1 ms forwards on a shared 2-core machine: this test is about real forwards and the cache, so it accepts
# any table; test_profile_robust.py checks the check on recorded tables
ANY_TABLE = TableCheck(max_drop=0.99, max_exponent=1e3, max_spread=1e3)


def test_profile_then_reuse_cache(tmp_path: Path, target_dir: Path, draft_dir: Path) -> None:
    cache = ProfileCache(tmp_path / "cache")
    t, d = runner(target_dir), runner(draft_dir)
    first = profile_models(t, d, target_path=target_dir, draft_path=draft_dir, cfg=FAST, cache=cache,
                           progress=False, check=ANY_TABLE)
    assert not first.cached and first.problems == ()
    assert first.data["target"]["check"]["ok"] and first.data["draft"]["check"]["attempts"] == 1
    assert all(row["spread"] >= 0 for row in first.data["target"]["table"])
    grid = [row["n_tokens"] for row in first.data["target"]["table"]]
    assert grid == [1, 2, 4, 8, 16, 32]
    assert first.knee in grid and first.budget == max(first.knee, speculation_floor())
    assert first.draft_cost is not None
    assert all(row["latency_ms"] > 0 for row in first.data["target"]["table"])
    assert t.cache.free_pages == t.cache.num_pages  # probing leaves the KV cache empty

    again = profile_models(t, d, target_path=target_dir, draft_path=draft_dir, cfg=FAST, cache=cache,
                           progress=False, check=ANY_TABLE)
    assert again.cached and again.budget == first.budget and again.target_cost == first.target_cost
    forced = profile_models(t, d, target_path=target_dir, draft_path=draft_dir, cfg=FAST, cache=cache,
                            force=True, progress=False, check=ANY_TABLE)
    assert not forced.cached


def test_model_identity_changes_with_config(tmp_path: Path, target_dir: Path, draft_dir: Path) -> None:
    assert model_identity(target_dir) != model_identity(draft_dir)
    assert model_identity(target_dir) == model_identity(target_dir)


@pytest.mark.parametrize("weights", ["int4", "float"])
def test_a_model_on_other_kernels_is_profiled_afresh(tmp_path: Path, target_dir: Path,
                                                     monkeypatch: pytest.MonkeyPatch, weights: str) -> None:
    """Costs belong to the kernels measured: the same int4 model on torch's kernels and on the integer ones (or on
    another build of them) keeps two profiles, never one read for the other; so does a float model attending with
    torch's SDPA and with the kernels' attention (native/attend.c)."""
    from adaserve.engine.config import EngineConfig
    from adaserve.engine.loading.loader import load_model
    from adaserve.engine.model import native_kernels
    from adaserve.engine.model.runner import ModelRunner

    if native_kernels.kernels() is None:
        pytest.skip("the integer kernels do not build here: only torch's can be profiled")
    cache = ProfileCache(tmp_path / "cache")

    def profiled(mode: str) -> bool:
        monkeypatch.setenv(native_kernels.ENV, mode)
        r = ModelRunner(load_model(target_dir, device=torch.device("cpu"), weights=weights), EngineConfig())
        return profile_models(r, None, target_path=target_dir, draft_path=None, cfg=FAST, cache=cache,
                              progress=False, check=ANY_TABLE).cached

    assert [profiled("off"), profiled("on"), profiled("off"), profiled("on")] == [False, False, True, True]
    assert len(list((tmp_path / "cache").rglob("*.json"))) == 2


@pytest.mark.parametrize("as_json", [True, False])
def test_profile_cli(tmp_path: Path, target_dir: Path, as_json: bool) -> None:
    env_cmd = [sys.executable, "-m", "adaserve", "profile", "--target", str(target_dir), "--max-tokens", "16",
               "--context", "16", "--repeats", "2", "--plot", str(tmp_path / "roofline.png")]
    if as_json:
        env_cmd.append("--json")
    res = subprocess.run(env_cmd, capture_output=True, text=True, timeout=300,
                         env={**__import__("os").environ, "ADASERVE_CACHE_DIR": str(tmp_path / "c")})
    assert res.returncode == 0, res.stderr
    assert (tmp_path / "roofline.png").stat().st_size > 1000
    if as_json:
        data = json.loads(res.stdout)
        assert data["target"]["budget"] in [1, 2, 4, 8, 16]
        keys = set(data["target"]["cost_model"])
        assert {"alpha", "gamma", "delta"} <= keys <= {"alpha", "gamma", "delta", "gamma_above", "knee", "beta"}
        assert "mean_rel_error" in data["target"]["fit"]
        assert data["profiling_seconds"] > 0
    else:
        assert "budget B =" in res.stdout


def test_the_profile_cli_measures_the_workers_cache() -> None:
    """``adaserve profile`` sizes the KV cache as a worker does by default: the cache decides how many sequences the
    long-context probes spread over (part of the profile's key), so its profile is the one ``adaserve up`` reads."""
    from adaserve.cli.main import build_parser
    from adaserve.worker.settings import WorkerSettings

    assert build_parser().parse_args(["profile"]).kv_memory_mb == WorkerSettings.model_fields["kv_memory_mb"].default


def stub(device: str, capacity_tokens: int) -> Any:
    """What ``probe_plan`` reads of a runner: its device and its cache's capacity."""
    return SimpleNamespace(device=torch.device(device), cache=SimpleNamespace(capacity_tokens=capacity_tokens))


def test_a_cpu_profile_also_probes_a_long_context_where_the_cache_holds_it() -> None:
    """On a CPU the probes add 1,024 cached tokens to 64 and 256 (a narrow span misjudged the cost of a context token):
    over 8 sequences and the whole grid where the cache holds them beside it, else up to n = 16 over 2 sequences
    (chains of up to 8 tokens: what separates a cell's cost), over 1 where the cache holds one, not at all where it
    holds none; a GPU keeps its contexts (and so do the simulated devices, which fit ``fit_contexts`` themselves)."""
    cfg = ProfilerConfig()
    every, grid = {64: 8, 256: 8}, {64: 256, 256: 256}
    roomy = probe_plan(stub("cpu", 2 * (8 * 1024 + 256)), cfg)
    assert roomy == ((64, 256, 1024), 256, every | {1024: 8}, grid | {1024: 256}) and roomy.label() == "64,256,1024"
    # one token short of that: 2 sequences up to n = 16
    assert probe_plan(stub("cpu", 2 * (8 * 1024 + 255)), cfg).label() == "64,256,1024x2:16"
    # SmolLM2-135M's 256 MiB cache: 5,824 tokens
    default_target = probe_plan(stub("cpu", 5824), cfg)
    assert default_target == ((64, 256, 1024), 256, every | {1024: 2}, grid | {1024: 16})
    assert default_target.label() == "64,256,1024x2:16"
    assert probe_plan(stub("cpu", 5824), ProfilerConfig(cpu_sequences=1)).label() == "64,256,1024x1:16"
    # a cache too small for the grid (its probes stop at n = 1) holds one sequence of 1,024 beside one new token
    assert probe_plan(stub("cpu", 2 * 1100), cfg) == ((64, 256, 1024), 1, every | {1024: 1}, {64: 1, 256: 1, 1024: 1})
    assert probe_plan(stub("cpu", 1000), cfg) == ((64, 256), 1, every, {64: 1, 256: 1})  # none: as before
    assert probe_plan(stub("cuda", 10**6), cfg) == ((64, 256), 1024, every, {64: 1024, 256: 1024})
    assert probe_plan(stub("cpu", 10**6), ProfilerConfig(cpu_contexts=())).label() == "64,256"
    # every probe: each context over the grid of n up to its largest
    assert probe_grid(stub("cpu", 10**6), ProfilerConfig(max_tokens=4)) == [
        (64, 1), (64, 2), (64, 4), (256, 1), (256, 2), (256, 4), (1024, 1), (1024, 2), (1024, 4)]
    assert probe_grid(stub("cpu", 5824), cfg)[-6:] == [(256, 256), (1024, 1), (1024, 2), (1024, 4), (1024, 8),
                                                        (1024, 16)]
    for bad in ({"cpu_contexts": (0,)}, {"cpu_sequences": 0}, {"cpu_max_tokens": 0}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            ProfilerConfig(**bad)  # type: ignore[arg-type]


def test_probes_at_a_capped_context_spread_over_its_sequences(target_dir: Path) -> None:
    """A probe of n tokens at a context capped to b sequences runs min(n, b) chains (the timer's forward), and the
    fit reads its samples as such: N_context = min(n, b) * c and the cells of those chains."""
    t = runner(target_dir)
    seen: list[list[int]] = []
    forward = t.forward

    def spy(segs: Any, **kw: Any) -> Any:
        seen.append([s.tree.size for s in segs])
        assert {s.prefix_len for s in segs} == {16}
        return forward(segs, **kw)

    t.forward = spy  # type: ignore[method-assign]
    timer = forward_timer(t, {16: 2})
    for n in (1, 2, 8):
        assert timer(n, 16) > 0
    assert seen == [[1], [1, 1], [4, 4]]
    assert t.cache.free_pages == t.cache.num_pages
    assert probe_split(8, 2) == [4, 4] and probe_split(8) == [1] * 8 and probe_split(3, 2) == [2, 1]

    # the fit: a cost 1 ms per context token and 1 ms per cell (b = 2 at context 1,024, 8 at 64)
    def ms(n: int, c: int, b: int) -> float:
        split = probe_split(n, b)
        return 1e-3 * (len(split) * c + sum(chunk_cells(k, c) for k in split))

    grid = (1, 2, 4, 8, 16)
    timings = {c: {n: [ms(n, c, b)] * 3 for n in grid} for c, b in ((64, 8), (256, 8), (1024, 2))}
    fitted = CostModel.from_dict(summarise_timings(timings, context=256, most={1024: 2})["cost_model"])
    assert fitted.alpha == pytest.approx(1e-3, rel=1e-6) and fitted.beta == pytest.approx(1e-3, rel=1e-6)
    # read as 8 sequences, the same timings fit something else
    wrong = CostModel.from_dict(summarise_timings(timings, context=256)["cost_model"])
    assert wrong.alpha != pytest.approx(1e-3, rel=1e-2) or wrong.beta != pytest.approx(1e-3, rel=1e-2)
