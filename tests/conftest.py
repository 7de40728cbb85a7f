"""Shared fixtures: small random checkpoints built once per session, and runners over them."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
import torch

from tests.models import make_checkpoint

logging.getLogger("transformers").setLevel(logging.ERROR)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--with-gpu", action="store_true", help="also run tests that need a CUDA device")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # ``slow`` tests stay out of the default run (README's test command) unless a -m expression names them
    slow = "slow" in (config.option.markexpr or "")
    skip_slow = pytest.mark.skip(reason="slow test: run with -m slow")
    gpu = config.getoption("--with-gpu")
    skip_gpu = pytest.mark.skip(reason="GPU test: run with --with-gpu on a CUDA machine")
    for item in items:
        if "gpu" in item.keywords and not gpu:
            item.add_marker(skip_gpu)
        if "slow" in item.keywords and not slow:
            item.add_marker(skip_slow)


@pytest.fixture(scope="session", autouse=True)
def _threads() -> None:
    # tiny test models gain nothing from threads, and OpenMP spin-waits collapse under oversubscription
    torch.set_num_threads(1)


@pytest.fixture(scope="session", autouse=True)
def _profile_cache(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Profiles go to a per-session folder (subprocesses inherit it), never the user's cache."""
    os.environ["ADASERVE_CACHE_DIR"] = str(tmp_path_factory.mktemp("profiles"))


@pytest.fixture(scope="session")
def ckpt_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("ckpt")


@pytest.fixture(scope="session")
def target_dir(ckpt_dir: Path) -> Path:
    return make_checkpoint(ckpt_dir / "target", "llama", seed=0)


@pytest.fixture(scope="session")
def draft_dir(ckpt_dir: Path) -> Path:
    """A different random model: its proposals are mostly rejected, exercising the rejection paths."""
    return make_checkpoint(ckpt_dir / "draft", "llama", seed=1, num_hidden_layers=1)
