"""The KV cache sized from the device's memory (issue 30, item 3): the pure sizing with made-up numbers, the
option from the command line to ``KVCacheConfig``, and bad values as one-line CLI errors (exit 2)."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from adaserve.engine import build
from adaserve.engine.build import EngineBuildError, build_engine
from adaserve.engine.model.kv_cache import bytes_per_token
from adaserve.engine.model.kv_sizing import (
    CPU_CAP_BYTES,
    KVSizingError,
    device_memory,
    kv_budget_bytes,
    pages_for_budget,
)

GiB = 2**30


def test_cuda_budget_is_the_fraction_of_total_less_what_the_device_holds() -> None:
    # 80 GiB card, 20 GiB held (weights, other processes), a forward peaks at 2 GiB more
    b = kv_budget_bytes(0.9, device_type="cuda", total=80 * GiB, free=60 * GiB, activation_peak=2 * GiB)
    assert b == int(0.9 * 80 * GiB) - 20 * GiB - 2 * GiB
    with pytest.raises(KVSizingError, match="leaves no room"):
        kv_budget_bytes(0.2, device_type="cuda", total=80 * GiB, free=60 * GiB)


def test_cuda_graphs_get_their_own_share() -> None:
    b = kv_budget_bytes(0.9, device_type="cuda", total=80 * GiB, free=60 * GiB, activation_peak=2 * GiB,
                        graph_reserve=3 * GiB)
    assert b == int(0.9 * 80 * GiB) - 20 * GiB - 2 * GiB - 3 * GiB
    with pytest.raises(KVSizingError, match=r"its CUDA graphs 3\.00 GiB"):
        kv_budget_bytes(0.3, device_type="cuda", total=80 * GiB, free=60 * GiB, activation_peak=2 * GiB,
                        graph_reserve=3 * GiB)


def test_static_shapes_on_cuda_set_each_models_peak_aside_for_its_graphs(monkeypatch: pytest.MonkeyPatch,
                                                                         target_dir: Path, draft_dir: Path) -> None:
    """``kv_from_memory`` as a CUDA worker runs it, the device's numbers made up (no GPU here): the models' peaks
    are set aside once for the eager forwards (the largest) and, with static shapes, once more each for the graphs'
    pools."""
    from adaserve.engine.config import EngineConfig
    from adaserve.engine.loading.loader import load_model

    models = [load_model(p, device=torch.device("cpu")) for p in (target_dir, draft_dir)]
    peaks = {id(models[0]): 300 * 2**20, id(models[1]): 100 * 2**20}
    monkeypatch.setattr(build, "activation_peak", lambda m, cfg, device: peaks[id(m)])
    monkeypatch.setattr(build, "device_memory", lambda device: (3 * GiB, 4 * GiB))
    per_token = [bytes_per_token(m.cfg, m.lm_head.weight.dtype) for m in models]
    cuda = torch.device("cuda")
    for static, graphs in ((False, 0), (True, 400 * 2**20)):
        kv = build.kv_from_memory(models, EngineConfig(static_shapes=static), 0.5, cuda)
        want = int(0.5 * 4 * GiB) - GiB - 300 * 2**20 - graphs
        assert kv.num_pages == pages_for_budget(want, per_token, kv.page_size)
    cpu = build.kv_from_memory(models, EngineConfig(static_shapes=True), 0.5, torch.device("cpu"))
    assert cpu.num_pages == pages_for_budget(int(0.5 * 3 * GiB), per_token, cpu.page_size)  # a CPU: no graphs


def test_cpu_budget_is_a_capped_fraction_of_available_ram() -> None:
    assert kv_budget_bytes(0.5, device_type="cpu", total=64 * GiB, free=10 * GiB) == 5 * GiB
    assert kv_budget_bytes(0.5, device_type="cpu", total=256 * GiB, free=200 * GiB) == CPU_CAP_BYTES
    for bad in (0.0, -0.1, 1.5):
        with pytest.raises(KVSizingError, match=r"\(0, 1\]"):
            kv_budget_bytes(bad, device_type="cpu", total=GiB, free=GiB)


def test_pages_give_every_model_the_same_tokens_within_the_budget() -> None:
    per_token = [36_864, 9_216]  # a target and a smaller draft
    pages = pages_for_budget(GiB, per_token, 16)
    assert pages * 16 * sum(per_token) <= GiB < (pages + 1) * 16 * sum(per_token)
    with pytest.raises(KVSizingError, match="holds no page"):
        pages_for_budget(1000, per_token, 16)


def test_device_memory_reads_ram_on_a_cpu() -> None:
    free, total = device_memory(torch.device("cpu"))
    assert 0 < free <= total


def test_fraction_sizes_both_caches_alike(monkeypatch: pytest.MonkeyPatch, target_dir: Path,
                                          draft_dir: Path) -> None:
    monkeypatch.setattr(build, "device_memory", lambda device: (400 * 2**20, 1000 * 2**20))
    built = build_engine(target=target_dir, draft=draft_dir, budget=16, profile=False, progress=False,
                         kv_memory_fraction=0.25)
    eng = built.engine
    assert eng.draft is not None
    per_token = [bytes_per_token(r.model.cfg, r.dtype) for r in (eng.target, eng.draft)]
    expect = pages_for_budget(100 * 2**20, per_token, eng.target.cache.page_size)
    assert eng.target.cache.num_pages == eng.draft.cache.num_pages == expect
    with pytest.raises(EngineBuildError, match=r"\(0, 1\]"):
        build_engine(target=target_dir, draft=None, policy="incremental", budget=16, profile=False, progress=False,
                     kv_memory_fraction=2.0)


def test_worker_option_reaches_the_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    from adaserve.cli.main import build_parser
    from adaserve.cli.worker import load_settings

    monkeypatch.delenv("ADASERVE_KV_MEMORY_FRACTION", raising=False)
    args = build_parser().parse_args(["worker", "--kv-memory-fraction", "0.8"])
    assert isinstance(args, argparse.Namespace)
    assert load_settings(args).kv_memory_fraction == 0.8
    args = build_parser().parse_args(["worker"])
    monkeypatch.setenv("ADASERVE_KV_MEMORY_FRACTION", "0.5")
    assert load_settings(args).kv_memory_fraction == 0.5


@pytest.mark.parametrize("argv", [["worker", "--kv-memory-fraction", "1.5"], ["up", "--kv-memory-fraction", "0"],
                                  ["worker", "--kv-memory-fraction", "most"]])
def test_a_bad_fraction_is_a_one_line_cli_error(argv: list[str]) -> None:
    r = subprocess.run([sys.executable, "-m", "adaserve", *argv], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert "--kv-memory-fraction" in r.stderr and "(0, 1]" in r.stderr and "Traceback" not in r.stderr
