"""Every AdaServeDeployment the chart's docs and the kind script show is one the cluster would accept: valid
against the CRD's schema and CEL rules (tests/operator/schema.py) and the operator's own copy of those
rules. The kind script cannot run here, so this is also its only automatic check that its CPU resource
really runs on CPU."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from adaserve.operator import builders
from adaserve.operator.spec import parse_spec
from tests.chart.helpers import CHART, ROOT
from tests.operator.schema import load_crd, validate


def yaml_blocks(path: Path) -> list[dict[str, Any]]:
    text = path.read_text()
    docs = [yaml.safe_load(b) for b in re.findall(r"```yaml\n(.*?)```", text, flags=re.S)]
    return [d for d in docs if isinstance(d, dict) and d.get("kind") == "AdaServeDeployment"]


def kind_script_resource() -> dict[str, Any]:
    script = (ROOT / "scripts" / "kind-e2e.sh").read_text()
    (body,) = re.findall(r"apply -f - <<EOF\n(.*?)\nEOF\n", script, flags=re.S)
    values = {"NS": "adaserve-e2e", "TAG": "e2e", "BUDGET": "auto", "REDIS_IMAGE": "redis:7-alpine"}
    return yaml.safe_load(re.sub(r"\$(\w+)", lambda m: values[m.group(1)], body))


EXAMPLES = {
    "chart README": yaml_blocks(CHART / "README.md"),
    "docs/kubernetes.md": yaml_blocks(ROOT / "docs" / "kubernetes.md"),
    "kind-e2e.sh": [kind_script_resource()],
}


def test_the_docs_show_examples() -> None:
    assert all(EXAMPLES.values())


@pytest.mark.parametrize("where", EXAMPLES)
def test_documented_resources_satisfy_the_crd_schema_and_rules(where: str) -> None:
    crd = load_crd()
    (version,) = crd["spec"]["versions"]
    for doc in EXAMPLES[where]:
        assert doc["apiVersion"] == f"{crd['spec']['group']}/{version['name']}"
        assert validate(doc, crd) == []  # defaults, schema, CEL rules: the API server's verdict
        parse_spec(doc["spec"])  # the CEL rules, as the operator mirrors them


def test_kind_resource_runs_on_cpu_from_the_demo_models_in_the_image() -> None:
    doc = kind_script_resource()
    spec = parse_spec(doc["spec"])
    (worker,) = [c for c in builders.children(spec, name="demo", namespace="adaserve-e2e")
                 if c["kind"] == "Deployment" and c["metadata"]["name"] == "demo-worker"]
    (container,) = worker["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["ADASERVE_DEVICE"] == "cpu"
    assert "nvidia.com/gpu" not in container["resources"].get("limits", {})
    # docker/worker.Dockerfile copies models/demo to /app/models/demo
    assert env["ADASERVE_TARGET"] == "/app/models/demo/target"
    assert (ROOT / "models" / "demo" / "target" / "config.json").is_file()
    assert "COPY models/demo /app/models/demo" in (ROOT / "docker" / "worker.Dockerfile").read_text()
