"""``adaserve worker``'s options reach its settings: prefix caching on by default, off by flag or environment."""

from __future__ import annotations

from pathlib import Path

import pytest

from adaserve.cli.main import build_parser
from adaserve.cli.worker import load_settings


@pytest.fixture
def target(tmp_path: Path) -> str:
    (tmp_path / "config.json").write_text("{}")
    return str(tmp_path)


def settings(*argv: str):
    return load_settings(build_parser().parse_args(["worker", "--policy", "incremental", *argv]))


def test_prefix_caching_is_on_unless_turned_off(target: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ADASERVE_ENABLE_PREFIX_CACHING", raising=False)
    assert settings("--target", target).enable_prefix_caching is True
    assert settings("--target", target, "--no-enable-prefix-caching").enable_prefix_caching is False
    monkeypatch.setenv("ADASERVE_ENABLE_PREFIX_CACHING", "false")
    assert settings("--target", target).enable_prefix_caching is False
    assert settings("--target", target, "--enable-prefix-caching").enable_prefix_caching is True  # the flag wins
