"""The Grafana dashboard the chart ships: well-formed, every query names a series a worker or a gateway exports
(with labels it has), and the ConfigMap renders only when asked, with the sidecar's label."""

from __future__ import annotations

import json
import re
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml
from prometheus_client import CollectorRegistry

from adaserve.gateway.metrics import GatewayMetrics
from adaserve.worker.metrics import WorkerMetrics
from tests.chart.helpers import CHART, KUBE_VERSION, Render, one, only

DASHBOARD = CHART / "dashboards" / "adaserve.json"

# The parts of Grafana's dashboard model (schemaVersion 39) that a dashboard needs to load and that the
# sidecar's provisioning reads: what the JSON must hold, not every optional field Grafana knows.
TARGET = {"type": "object", "required": ["refId", "expr", "datasource"],
          "properties": {"refId": {"type": "string"}, "expr": {"type": "string", "minLength": 1}}}
GRID = {"type": "object", "required": ["h", "w", "x", "y"],
        "properties": {k: {"type": "integer", "minimum": 0} for k in ("h", "w", "x", "y")}}
PANEL = {"type": "object", "required": ["id", "type", "title", "gridPos"],
         "properties": {"id": {"type": "integer"}, "type": {"enum": ["row", "timeseries", "stat", "gauge"]},
                        "title": {"type": "string", "minLength": 1}, "gridPos": GRID,
                        "targets": {"type": "array", "items": TARGET, "minItems": 1}},
         "if": {"properties": {"type": {"const": "row"}}}, "else": {"required": ["targets", "datasource"]}}
SCHEMA = {"type": "object", "required": ["title", "uid", "schemaVersion", "panels", "templating", "time"],
          "properties": {"title": {"type": "string"}, "uid": {"type": "string", "pattern": "^[a-zA-Z0-9_-]{1,40}$"},
                         "schemaVersion": {"type": "integer", "minimum": 36},
                         "panels": {"type": "array", "items": PANEL, "minItems": 1},
                         "templating": {"type": "object", "required": ["list"]}}}

SERIES = re.compile(r"\b((?:adaserve_|vllm:)[A-Za-z0-9_:]*)(\{[^}]*\})?")
MATCHER = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)\s*(?:=~|!~|!=|=)")
PER_SERIES = {"le"}  # a histogram's bucket label
PER_TARGET = {"pod", "instance", "namespace", "job"}  # what Prometheus adds to every scraped series


def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def exported() -> dict[str, set[str]]:
    """Every series name a worker or a gateway can export (``_total``, ``_bucket``, ... included), with its label
    names: each metric's own, plus the ``model_name`` every worker series carries."""
    worker, gateway = WorkerMetrics(model_name="m"), GatewayMetrics()
    labels_of = {c._name: set(c._labelnames) for m in (worker, gateway) for c in vars(m).values()
                 if hasattr(c, "_labelnames")}
    labels_of.update({name: set() for name in worker.vllm})
    out: dict[str, set[str]] = {}
    registries: tuple[tuple[CollectorRegistry, set[str]], ...] = ((worker.registry, {"model_name"}),
                                                                   (gateway.registry, set()))
    for registry, extra in registries:
        for family in registry.collect():
            base = labels_of.get(family.name, set()) | extra
            suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_count", "_sum")}.get(family.type, ("",))
            for s in suffixes:
                out[family.name + s] = base | ({"le"} if s == "_bucket" else set())
    return out


def queries() -> list[tuple[str, str]]:
    return [(p["title"], t["expr"]) for p in dashboard()["panels"] for t in p.get("targets", [])]


def test_the_dashboard_is_well_formed() -> None:
    doc = dashboard()
    jsonschema.Draft7Validator(SCHEMA).validate(doc)
    ids = [p["id"] for p in doc["panels"]]
    assert len(ids) == len(set(ids))
    assert all(p["gridPos"]["x"] + p["gridPos"]["w"] <= 24 for p in doc["panels"])
    variables = {v["name"] for v in doc["templating"]["list"]}
    used = set(re.findall(r"\$\{?([a-z]+)", json.dumps(doc))) - {"__rate_interval"}
    assert used <= variables, used - variables


def test_every_query_names_an_exported_series_with_labels_it_has() -> None:
    series = exported()
    assert "adaserve_spec_draft_tokens_total" in series and "adaserve_gateway_slo_requests_total" in series
    seen = set()
    for title, expr in queries():
        found = SERIES.findall(expr)
        assert found, f"{title}: names no adaserve series: {expr}"
        for name, selector in found:
            assert name in series, f"{title}: {name} is exported by neither a worker nor a gateway"
            unknown = set(MATCHER.findall(selector)) - series[name] - PER_TARGET
            assert not unknown, f"{title}: {name} has no label {unknown}"
            seen.add(name)
        for group in re.findall(r"by \(([^)]*)\)", expr):
            labels = {g.strip() for g in group.split(",")} - PER_SERIES - PER_TARGET
            assert any(labels <= series[n] for n, _ in found), f"{title}: no series of it has {labels}"
    # what the issue asks the dashboard to show
    for wanted in ("adaserve_gateway_slo_requests_total", "adaserve_gateway_goodput_tokens_total",
                   "adaserve_gateway_ttft_seconds_bucket", "adaserve_gateway_tpot_seconds_bucket",
                   "adaserve_spec_accepted_tokens_total", "adaserve_budget_used_ratio_bucket",
                   "adaserve_kv_cache_usage_ratio", "adaserve_inter_token_latency_seconds_bucket"):
        assert wanted in seen, wanted


def test_no_dashboard_by_default(render: Render) -> None:
    assert [d for d in only(render(), "ConfigMap") if d["metadata"]["name"].endswith("-dashboard")] == []


@pytest.mark.parametrize("values", [{}, {"namespace": "monitoring", "labels": {"grafana_dashboard": "adaserve"},
                                        "annotations": {"grafana_folder": "LLM"}}])
def test_dashboard_config_map_for_the_sidecar(render: Render, values: dict[str, Any]) -> None:
    cm = one(render({"grafanaDashboard": {"enabled": True, **values}}), "ConfigMap")
    kubernetes_validate.validate(cm, KUBE_VERSION, strict=True)
    assert cm["metadata"]["labels"]["grafana_dashboard"] == values.get("labels", {}).get("grafana_dashboard", "1")
    assert cm["metadata"]["namespace"] == values.get("namespace", "adaserve-system")
    assert cm["metadata"].get("annotations", {}) == values.get("annotations", {})
    assert json.loads(cm["data"]["adaserve.json"]) == dashboard()


# ---- the autoscaling examples of docs/kubernetes.md ----------------------------------------------------------

def autoscaling_examples() -> list[dict[str, Any]]:
    text = (CHART.parents[1] / "docs" / "kubernetes.md").read_text()
    section = text.split("\n## Dashboard and autoscaling\n", 1)[1].split("\n## ", 1)[0]
    return [yaml.safe_load(block) for block in re.findall(r"```yaml\n(.*?)```", section, flags=re.S)]


def test_autoscaling_examples_target_the_crds_scale_subresource() -> None:
    crd = yaml.safe_load((CHART / "crds" / "adaserve.io_adaservedeployments.yaml").read_text())
    served = {f"{crd['spec']['group']}/{v['name']}" for v in crd["spec"]["versions"]
              if v["served"] and v.get("subresources", {}).get("scale")}
    examples = autoscaling_examples()
    assert {e["kind"] for e in examples} == {"ScaledObject", "HorizontalPodAutoscaler"}
    for e in examples:
        ref = e["spec"]["scaleTargetRef"]
        assert ref["kind"] == crd["spec"]["names"]["kind"] and ref["apiVersion"] in served, ref
        if e["kind"] == "HorizontalPodAutoscaler":
            kubernetes_validate.validate(e, KUBE_VERSION, strict=True)
            names = [m["pods"]["metric"]["name"] for m in e["spec"]["metrics"]]
        else:
            names = [n for t in e["spec"]["triggers"] for n, _ in SERIES.findall(t["metadata"]["query"])]
        assert names and all(n in exported() for n in names), names
