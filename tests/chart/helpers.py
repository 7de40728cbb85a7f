"""Running the real helm binary and picking objects out of what it renders."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "adaserve"
HELM = ROOT / ".tools" / "bin" / "helm"
KUBE_VERSION = "1.31.0"  # the cluster version we render for and validate against
RELEASE_NS = "adaserve-system"  # the namespace the tests install the chart into

# render(values=None, *, crds=False, namespace=RELEASE_NS) -> the rendered objects (conftest.render)
Render = Callable[..., list[dict[str, Any]]]

# helm's own state in a throwaway place: a user's repositories and plugins must not change a result
_HELM_ENV = {"HELM_CACHE_HOME": "/tmp/adaserve-helm/cache", "HELM_CONFIG_HOME": "/tmp/adaserve-helm/config",
             "HELM_DATA_HOME": "/tmp/adaserve-helm/data"}


def find_helm() -> Path:
    """.tools/bin/helm, fetched by scripts/get-k8s-tools.sh when absent. Missing helm skips the tests with a
    reason on a laptop and fails them in CI (CI=true), where a missing tool must never look like a pass."""
    if not HELM.exists():
        proc = subprocess.run([str(ROOT / "scripts" / "get-k8s-tools.sh")], cwd=ROOT, capture_output=True,
                              text=True, timeout=600, check=False)
        if proc.returncode != 0 or not HELM.exists():
            why = f"helm unavailable: scripts/get-k8s-tools.sh exited {proc.returncode}: {proc.stderr.strip()[-500:]}"
            if os.environ.get("CI") == "true":
                pytest.fail(why)
            pytest.skip(why)
    return HELM


def run_helm(helm: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(helm), *args], capture_output=True, text=True, timeout=60, check=False,
                          env={**os.environ, **_HELM_ENV})


def template_args(values_file: Path, *, namespace: str = RELEASE_NS, crds: bool = False) -> list[str]:
    args = ["template", "rel", str(CHART), "--namespace", namespace, "--kube-version", KUBE_VERSION,
            "-f", str(values_file)]
    return [*args, "--include-crds"] if crds else args


def only(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


def one(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    found = only(docs, kind)
    assert len(found) == 1, f"expected one {kind}, got {[d['metadata']['name'] for d in found]}"
    return found[0]
