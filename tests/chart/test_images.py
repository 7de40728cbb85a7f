"""The operator and gateway images install adaserve with --no-deps plus docker/requirements-*.txt: every
third-party module their code can import must be in that file, and torch must not be reachable at all.
A static walk of the imports (no docker here), following adaserve's own modules, including the parent
packages Python runs first."""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest

from tests.chart.helpers import ROOT, Render

# distribution name (as in requirements files) -> the top-level module it provides, where they differ
MODULE_OF = {"pyyaml": "yaml", "prometheus-client": "prometheus_client", "pydantic-settings": "pydantic_settings"}


def requirements(component: str) -> set[str]:
    lines = (ROOT / "docker" / f"requirements-{component}.txt").read_text().splitlines()
    names = {re.split(r"[<>=!~\[ ]", ln.strip(), maxsplit=1)[0].lower() for ln in lines if ln.strip()
             and not ln.lstrip().startswith("#")}
    return {MODULE_OF.get(n, n.replace("-", "_")) for n in names}


def module_file(name: str) -> Path | None:
    base = ROOT.joinpath(*name.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def third_party_imports(package: str) -> dict[str, set[str]]:
    """top-level third-party module -> the adaserve modules that import it, over the import closure."""
    found: dict[str, set[str]] = {}
    seen: set[str] = set()
    todo = [m.relative_to(ROOT).with_suffix("").as_posix().replace("/", ".").removesuffix(".__init__")
            for m in ROOT.joinpath(*package.split(".")).rglob("*.py")]
    while todo:
        name = todo.pop()
        parts = name.split(".")
        todo += [".".join(parts[:i]) for i in range(1, len(parts)) if ".".join(parts[:i]) not in seen]
        if name in seen or (path := module_file(name)) is None:
            continue
        seen.add(name)
        for node in ast.walk(ast.parse(path.read_text())):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            for t in targets:
                top = t.split(".")[0]
                if top == "adaserve":
                    todo.append(t)
                elif top not in sys.stdlib_module_names and top != "__future__":
                    found.setdefault(top, set()).add(name)
    return found


@pytest.mark.parametrize("component", [
    "operator",
    "gateway",
])
def test_image_requirements_cover_every_import_and_exclude_torch(component: str) -> None:
    imports = third_party_imports(f"adaserve.{component}")
    assert "torch" not in imports, f"torch reachable from: {sorted(imports['torch'])}"
    missing = {m: sorted(by) for m, by in imports.items() if m not in requirements(component)}
    assert missing == {}, f"add to docker/requirements-{component}.txt: {missing}"


def dockerfile(component: str) -> str:
    return (ROOT / "docker" / f"{component}.Dockerfile").read_text()


@pytest.mark.parametrize(("component", "port"), [("operator", 8080), ("gateway", 8080)])
def test_slim_images_install_adaserve_without_its_dependencies(component: str, port: int) -> None:
    text = dockerfile(component)
    assert f"docker/requirements-{component}.txt" in text
    assert "pip install --no-deps /src" in text
    assert "torch" not in requirements(component)
    assert f"EXPOSE {port}" in text


@pytest.mark.parametrize("component", ["operator", "gateway", "worker"])
def test_images_run_as_the_chart_uid(component: str, render: Render) -> None:
    # the chart's podSecurityContext pins runAsUser; the image user must be the same uid
    (user,) = re.findall(r"^USER (\d+):\d+$", dockerfile(component), flags=re.M)
    pod = next(d for d in render() if d["kind"] == "Deployment")["spec"]["template"]["spec"]
    assert int(user) == pod["securityContext"]["runAsUser"] != 0


def test_worker_image_has_a_cuda_and_a_cpu_variant() -> None:
    text = dockerfile("worker")
    assert "ARG DEVICE=cuda" in text and "FROM base-${DEVICE}" in text
    assert "AS base-cuda" in text and "AS base-cpu" in text
    assert "flashinfer-python" in text.split("AS base-cpu")[0]  # CUDA stage only
    assert 'ENTRYPOINT ["adaserve"]' in text and 'CMD ["worker"]' in text and "EXPOSE 8000" in text
