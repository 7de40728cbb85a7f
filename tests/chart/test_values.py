"""The chart lints clean, its values schema rejects bad input with a readable message before anything
renders, and every value is documented in values.yaml and in the chart README."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import jsonschema
import pytest
import yaml

from tests.chart.helpers import CHART, run_helm

VALUES = CHART / "values.yaml"


def test_helm_lint_strict_passes(helm: Path) -> None:
    proc = run_helm(helm, "lint", "--strict", str(CHART))
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_default_values_satisfy_the_schema() -> None:
    schema = json.loads((CHART / "values.schema.json").read_text())
    jsonschema.Draft7Validator.check_schema(schema)
    jsonschema.Draft7Validator(schema).validate(yaml.safe_load(VALUES.read_text()))


@pytest.mark.parametrize(("setting", "message"), [
    ("operator.replicas=-1", "/operator/replicas"),
    ("operator.replicas=6", "/operator/replicas"),
    ("operator.image.pullPolicy=Sometimes", "/operator/image/pullPolicy"),
    ("operator.logLevel=loud", "/operator/logLevel"),
    ("operator.peering=Not_A_Name", "/operator/peering"),
    ("watchNamespaces={serving,Bad_NS}", "/watchNamespaces/1"),
    ("serviceMonitor.interval=often", "/serviceMonitor/interval"),
    ("serviceMonitor.enabled=yes-please", "/serviceMonitor/enabled"),
    ("operator.replica=1", "additional properties 'replica' not allowed"),
    ("watchNamespace={serving}", "additional properties 'watchNamespace' not allowed"),
])
def test_schema_rejects_bad_values_with_a_message(helm: Path, setting: str, message: str) -> None:
    proc = run_helm(helm, "template", "rel", str(CHART), "--set", setting)
    assert proc.returncode != 0
    assert "don't meet the specifications of the schema" in proc.stderr
    assert message in proc.stderr, proc.stderr


def test_a_borrowed_service_account_must_be_named(helm: Path) -> None:
    proc = run_helm(helm, "template", "rel", str(CHART), "--set", "serviceAccount.create=false")
    assert proc.returncode != 0 and "serviceAccount.name is required" in proc.stderr


KEY_LINE = re.compile(r"^( *)([A-Za-z][\w.-]*):")


@dataclass
class Key:
    path: str
    commented: bool  # its own comment block, directly above, starts with "# --"
    children: list[Key] = field(default_factory=list)

    def documented(self) -> bool:
        """Commented itself (its sub-keys are then part of one documented value), or a plain section whose
        every child is documented."""
        return self.commented or (bool(self.children) and all(c.documented() for c in self.children))

    def doc_paths(self) -> list[str]:
        """The dotted paths a reader looks up in the README: the commented keys."""
        return [self.path] if self.commented else [p for c in self.children for p in c.doc_paths()]


def value_keys(text: str) -> list[Key]:
    """values.yaml's keys as a tree, by indentation; YAML loaders drop the comments we check."""
    roots: list[Key] = []
    stack: list[tuple[int, Key]] = []
    comment: list[str] = []
    for line in text.splitlines():
        if line.strip().startswith("#"):
            comment.append(line.strip())
            continue
        if m := KEY_LINE.match(line):
            indent = len(m.group(1))
            while stack and stack[-1][0] >= indent:
                stack.pop()
            parent = stack[-1][1] if stack else None
            key = Key(f"{parent.path}.{m.group(2)}" if parent else m.group(2),
                      commented=bool(comment) and comment[0].startswith("# --"))
            (parent.children if parent else roots).append(key)
            stack.append((indent, key))
        comment = []  # a blank line or a value ends a comment block: it documents only the next key
    return roots


def test_every_value_is_documented_in_values_yaml() -> None:
    roots = value_keys(VALUES.read_text())
    assert {r.path for r in roots} == set(yaml.safe_load(VALUES.read_text()))  # the parser saw every key
    assert [r.path for r in roots if not r.documented()] == []


def test_every_value_is_in_the_readme_table() -> None:
    expected = {p for r in value_keys(VALUES.read_text()) for p in r.doc_paths()}
    readme = (CHART / "README.md").read_text()
    section = readme.split("\n## Values\n", 1)[1].split("\n## ", 1)[0]
    table = {m.group(1) for m in re.finditer(r"^\| `([\w.]+)` \|", section, flags=re.M)}
    assert table == expected
