"""Fixtures for the chart tests: the helm binary and a cached ``helm template``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.chart.helpers import RELEASE_NS, Render, find_helm, run_helm, template_args


@pytest.fixture(scope="session")
def helm() -> Path:
    return find_helm()


@pytest.fixture(scope="session")
def render(helm: Path, tmp_path_factory: pytest.TempPathFactory) -> Render:
    """render(values=None, *, crds=False, namespace=RELEASE_NS) -> the rendered objects, as dicts."""
    cache: dict[str, list[dict[str, Any]]] = {}
    tmp = tmp_path_factory.mktemp("values")

    def _render(values: dict[str, Any] | None = None, *, crds: bool = False,
                namespace: str = RELEASE_NS) -> list[dict[str, Any]]:
        text = yaml.safe_dump(values or {})
        key = f"{crds}|{namespace}|{text}"
        if key not in cache:
            vfile = tmp / f"values-{len(cache)}.yaml"
            vfile.write_text(text)
            proc = run_helm(helm, *template_args(vfile, namespace=namespace, crds=crds))
            assert proc.returncode == 0, proc.stderr
            cache[key] = [doc for doc in yaml.safe_load_all(proc.stdout) if doc]
        return cache[key]

    return _render
