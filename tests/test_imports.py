"""How the package hangs together: the slim services load no model stack, and no module imports itself back.

The gateway and the operator run in images without torch, and the contract is what they share with the
worker: importing any of them must load neither torch, numpy nor the engine. Each is imported in a fresh
interpreter, so what other tests loaded cannot hide an import.

The import graph is read from the source with ``ast``: module-level and function-level imports alike (a
function-level import is still a dependency; it only runs later), so a cycle cannot hide in a function.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "adaserve"
HEAVY = ("torch", "numpy", "adaserve.engine")

# Every module of these packages, __main__ included (its `if __name__ == "__main__"` keeps it from running).
SLIM = ("adaserve.contract", "adaserve.gateway", "adaserve.operator")

IMPORT_ALL = """
import importlib, json, pkgutil, sys
package = importlib.import_module(sys.argv[1])
names = [sys.argv[1]] + [m.name for m in pkgutil.walk_packages(package.__path__, sys.argv[1] + ".")]
for name in names:
    importlib.import_module(name)
heavy = tuple(sys.argv[2:])
loaded = sorted(m for m in sys.modules if m in heavy or m.startswith(tuple(h + "." for h in heavy)))
print(json.dumps({"imported": names, "heavy": loaded}))
"""


@pytest.mark.parametrize("package", SLIM)
def test_slim_packages_load_no_model_stack(package: str) -> None:
    done = subprocess.run([sys.executable, "-c", IMPORT_ALL, package, *HEAVY], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout)
    assert result["heavy"] == [], f"importing {package} loads {result['heavy'][:10]}"
    if package == "adaserve.gateway":  # the app factory and the container's entry point are among them
        assert {"adaserve.gateway.app", "adaserve.gateway.__main__"} <= set(result["imported"])
    if package == "adaserve.operator":
        assert {"adaserve.operator.handlers", "adaserve.operator.__main__"} <= set(result["imported"])


# ---- the import graph --------------------------------------------------------------------------------------

def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """The adaserve modules ``name`` imports anywhere in its source. ``from a.b import c`` is an edge to
    ``a.b.c`` when that is a module, else to ``a.b``; relative imports are resolved first."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        for t in targets:
            # `import a.b.c` runs a, a.b and a.b.c; the deepest adaserve module named is the dependency
            while t and t not in known:
                t = t.rpartition(".")[0]
            if t and t != name and t.startswith("adaserve"):
                out.add(t)
    return out


def graph() -> dict[str, set[str]]:
    found = modules()
    return {name: imports_of(name, path, set(found)) for name, path in found.items()}


def find_cycle(edges: dict[str, set[str]], within: set[str] | None = None) -> list[str] | None:
    """One cycle as [a, b, ..., a] (among the nodes ``within``, default all), or None: a depth-first search
    that marks the nodes on the current path."""
    nodes = set(edges) if within is None else within
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(edges.get(node, set()) & nodes):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt):], nxt]
            if nxt not in state and (cycle := visit(nxt)) is not None:
                return cycle
        path.pop()
        state[node] = 2
        return None

    for start in sorted(nodes):
        if start not in state and (cycle := visit(start)) is not None:
            return cycle
    return None


def knots(edges: dict[str, set[str]]) -> list[set[str]]:
    """The groups of modules that import each other (strongly connected components of two or more, or one
    that imports itself), by Tarjan's algorithm."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[set[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(edges.get(node, set())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = set()
            while node not in group:
                group.add(stack.pop())
            if len(group) > 1 or node in edges.get(node, set()):
                out.append(group)

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return out


def all_cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """One cycle in each knot, so a failure names every knot at once."""
    return sorted(c for group in knots(edges) if (c := find_cycle(edges, group)) is not None)


def test_the_graph_sees_function_level_and_relative_imports() -> None:
    edges = graph()
    assert "adaserve.cli_error" in edges["adaserve.cli.main"]
    assert "adaserve.gateway.server" in edges["adaserve.gateway.options"]  # imported inside run()
    assert "adaserve.contract.slo" in edges["adaserve.contract.generate"]


def test_cycle_finder_names_every_knot() -> None:
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a", "x"}, "d": {"a"}, "x": {"y"}, "y": {"x"}}
    assert find_cycle(edges) == ["a", "b", "c", "a"]
    assert all_cycles(edges) == [["a", "b", "c", "a"], ["x", "y", "x"]]
    assert all_cycles({"a": {"b"}, "b": set(), "c": {"a", "b"}}) == []


def test_no_import_cycles() -> None:
    cycles = all_cycles(graph())
    assert cycles == [], "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


# The one-way arrows of docs/architecture.md ("The house"): the packages each package may import (itself,
# the small leaves it needs, and `adaserve` itself for __version__). The gateway never imports the worker.
LEAVES = ("adaserve.access_log", "adaserve.error_fields", "adaserve.body_limit", "adaserve.redis_client")
ALLOWED = {
    "engine": ("adaserve.engine", "adaserve.plots"),
    "bench": ("adaserve.bench", "adaserve.engine", "adaserve.plots", "adaserve.allocator"),  # reports the allocator
    "training": ("adaserve.training", "adaserve.engine", "adaserve.bench.workload"),
    "contract": ("adaserve.contract",),
    "worker": ("adaserve.worker", "adaserve.engine", "adaserve.contract", *LEAVES),
    "gateway": ("adaserve.gateway", "adaserve.contract", "adaserve.cli_error", "adaserve.cli_settings", *LEAVES),
    "operator": ("adaserve.operator", "adaserve.contract", "adaserve.redis_client"),
}


def test_every_package_has_its_arrows() -> None:
    """A new package must be given its arrows here (the CLI, at the top, may import anything)."""
    packages = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()}
    assert packages == {*ALLOWED, "cli"}


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_imports_point_one_way(package: str) -> None:
    allowed = ALLOWED[package]
    edges = graph()
    bad = sorted(f"{name} -> {dep}" for name, deps in edges.items()
                 if name == f"adaserve.{package}" or name.startswith(f"adaserve.{package}.")
                 for dep in deps
                 if dep != "adaserve" and not any(dep == a or dep.startswith(a + ".") for a in allowed))
    assert not bad, f"adaserve/{package} may import only {allowed}: " + ", ".join(bad)


# ---- rooms: the engine and the bench in subpackages by job ---------------------------------------------

# Packages made of rooms: each subpackage is a room; the modules at the package's top are its core.
# Elsewhere a package is one room (a service's routes belong to the service).
SPLIT = ("adaserve.engine", "adaserve.bench")
# The engine's rooms and the rooms each may import (besides itself and the engine's leaves). The core,
# engine/*.py, imports the rooms; no room imports the core (docs/architecture.md, "The house").
ENGINE_ROOMS = {
    "model": (),
    "loading": ("model",),
    "speculation": ("model",),
    "cost": ("model", "speculation"),
}
ENGINE_TOP_MAX = 12  # modules at engine/'s top, leaves included: more, and the core wants a room of its own


def leaves(edges: dict[str, set[str]]) -> set[str]:
    """Modules that import nothing from adaserve: they cannot close a cycle, so any room may use them."""
    return {name for name, deps in edges.items() if not deps - {"adaserve"}}


def room_of(name: str, leaf: set[str]) -> str:
    """The room a module lives in: itself for a leaf or a module at the package root; the subpackage for a
    module under a SPLIT package (its top-level modules: the package itself); else its top-level package."""
    if name in leaf:
        return name
    parts = name.split(".")
    is_package = (ROOT.joinpath(*parts) / "__init__.py").exists()
    package = parts if is_package else parts[:-1]
    if len(package) == 1:  # adaserve/__init__.py, adaserve/__main__.py, adaserve/server_process.py, ...
        return name
    for split in SPLIT:
        if ".".join(package[:2]) == split:
            return ".".join(package[:3])
    return ".".join(package[:2])


def room_graph(edges: dict[str, set[str]]) -> dict[str, set[str]]:
    leaf = leaves(edges)
    out: dict[str, set[str]] = {}
    for name, deps in edges.items():
        here = room_of(name, leaf)
        out.setdefault(here, set()).update(r for d in deps if (r := room_of(d, leaf)) != here)
    return out


def test_room_of() -> None:
    leaf = {"adaserve.engine.checks"}
    assert room_of("adaserve.engine.model.attention.base", leaf) == "adaserve.engine.model"
    assert room_of("adaserve.engine.engine", leaf) == "adaserve.engine"
    assert room_of("adaserve.engine.checks", leaf) == "adaserve.engine.checks"
    assert room_of("adaserve.bench.sim.clock", leaf) == "adaserve.bench.sim"
    assert room_of("adaserve.worker.routes.generate", leaf) == "adaserve.worker"
    assert room_of("adaserve.server_process", leaf) == "adaserve.server_process"


def test_no_cycles_between_rooms() -> None:
    cycles = all_cycles(room_graph(graph()))
    assert cycles == [], "rooms that import each other:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_engine_rooms_never_import_the_core() -> None:
    edges = graph()
    leaf = leaves(edges)
    rooms = {p.name for p in (PACKAGE / "engine").iterdir() if (p / "__init__.py").exists()}
    assert rooms == set(ENGINE_ROOMS), "a new engine room needs its arrows in ENGINE_ROOMS"
    bad = []
    for name, deps in edges.items():
        room = room_of(name, leaf)
        if name in leaf or not room.startswith("adaserve.engine."):
            continue
        allowed = {room, *(f"adaserve.engine.{r}" for r in ENGINE_ROOMS[room.split(".")[2]])}
        bad += [f"{name} -> {d}" for d in deps if d.startswith("adaserve.engine")
                and room_of(d, leaf) not in allowed and d not in leaf]
    assert not bad, "an engine room imports the core or a room above it: " + ", ".join(sorted(bad))


def test_engine_top_is_the_core_and_its_leaves() -> None:
    top = sorted(p.stem for p in (PACKAGE / "engine").glob("*.py") if p.stem != "__init__")
    assert len(top) <= ENGINE_TOP_MAX, f"engine/ has {len(top)} modules at its top: {top}"
    edges = graph()
    used_by_rooms = {d for name, deps in edges.items() if name.count(".") >= 3 and name.startswith("adaserve.engine.")
                     for d in deps if d.count(".") == 2 and d.startswith("adaserve.engine.")}
    assert used_by_rooms <= leaves(edges), f"rooms import engine/ modules that are not leaves: {used_by_rooms}"
