"""scripts/huge-pages-microbench.py: a tensor copied onto a 2 MiB-aligned private mapping keeps its values, and the
microbench runs with the models moved there and a library's code remapped (a path that matches nothing: 0 bytes)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

from tests.scripts.helpers import SCRIPTS, load_script

ROOT = SCRIPTS.parent
THP = Path("/sys/kernel/mm/transparent_hugepage")
pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux") or not THP.is_dir(),
                                reason="needs Linux with transparent huge pages built in")


@pytest.fixture(scope="module")
def huge() -> ModuleType:
    return load_script("huge-pages-microbench.py")


def test_a_tensor_moved_keeps_its_values_on_an_aligned_mapping(huge: ModuleType) -> None:
    t = torch.arange(3 * 1000, dtype=torch.float32).view(3, 1000)
    moved = huge.on_huge_pages(t)
    assert torch.equal(moved, t) and moved.shape == t.shape and moved.dtype == t.dtype
    assert moved.data_ptr() % huge.HUGE == 0 and moved.data_ptr() != t.data_ptr()
    moved[0, 0] = -1.0  # its own memory
    assert t[0, 0] == 0.0


def test_the_microbench_runs_with_its_models_moved() -> None:
    done = subprocess.run([sys.executable, str(SCRIPTS / "huge-pages-microbench.py"), "--weights",
                           "--code", "no-such-library", "--model", "demo-tiny", "--batches", "1", "--modes", "plain",
                           "--count-steps", "0", "--threads", "1", "--steps", "2", "--warmup", "1", "--repeats", "1"],
                          capture_output=True, text=True, timeout=600, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout)
    assert report["benchmark"] == "engine-only" and report["cells"][0]["mode"] == "plain"
    assert "no-such-library 0 MiB" in done.stderr
    assert "weights and KV caches:" in done.stderr
