"""The engine's and the bench's import arrows (docs/architecture.md, "The house"): they point one way."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[2] / "adaserve"

# engine/ may use only itself, the package version and the plotting leaf; bench/ adds the engine
ALLOWED = {
    "engine": ("adaserve.engine", "adaserve.plots"),
    "bench": ("adaserve.bench", "adaserve.engine", "adaserve.plots"),
}


def adaserve_imports(path: Path) -> set[str]:
    """Every ``adaserve...`` module a file imports, at any depth (lazy imports inside functions too)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.split(".")[0] == "adaserve"}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("adaserve"):
            # ``from adaserve import __version__`` names an attribute, not a package
            out |= {node.module} if node.module != "adaserve" else set()
    return out


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_imports_point_down(package: str) -> None:
    allowed = ALLOWED[package]
    bad = {
        f"{path.relative_to(PKG.parent)}: {mod}"
        for path in sorted((PKG / package).rglob("*.py"))
        for mod in adaserve_imports(path)
        if not any(mod == a or mod.startswith(a + ".") for a in allowed)
    }
    assert not bad, f"adaserve/{package} may import only {allowed}: " + ", ".join(sorted(bad))


def test_the_check_sees_lazy_imports(tmp_path: Path) -> None:
    f = tmp_path / "m.py"
    f.write_text("def f():\n    from adaserve.worker.app import create_app\n    import adaserve.gateway\n")
    assert adaserve_imports(f) == {"adaserve.worker.app", "adaserve.gateway"}
