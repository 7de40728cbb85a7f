"""The chart's trust settings: NetworkPolicies (off by default) that admit exactly the operator's own pods, and
the opt-in Secret reads the operator needs to read workers from a Redis with a password.

The policies are checked against what the operator really renders (its builders' labels and ports) and against
the operator Deployment the chart renders, so a renamed label or port breaks a test, not a cluster."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import kubernetes_validate
import yaml

from adaserve.operator import builders, names
from adaserve.operator.spec import parse_spec
from tests.chart.helpers import CHART, KUBE_VERSION, RELEASE_NS, Render, one, only, run_helm
from tests.operator.schema import EXAMPLE_PATH

MONITORING = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}


def _selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """A LabelSelector (matchLabels, matchExpressions with In) against a pod's labels."""
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for e in selector.get("matchExpressions") or []:
        assert e["operator"] == "In", e
        if labels.get(e["key"]) not in e["values"]:
            return False
    return True


def _pod_labels() -> dict[str, dict[str, str]]:
    """The pod labels of every component the operator renders for the example, and of the operator itself."""
    spec = parse_spec(yaml.safe_load(EXAMPLE_PATH.read_text())["spec"])
    out = {}
    for child in builders.children(spec, name="llama", namespace="serving"):
        if child["kind"] == "Deployment":
            out[child["metadata"]["labels"][f"{names.GROUP}/component"]] = child["spec"]["template"]["metadata"][
                "labels"]
    return out


def test_no_network_policies_unless_enabled(render: Render) -> None:
    assert only(render({"watchNamespaces": ["serving"]}), "NetworkPolicy") == []


def test_network_policies_admit_only_the_operators_pods(render: Render) -> None:
    docs = render({"watchNamespaces": ["serving", "staging"], "networkPolicy": {"enabled": True,
                                                                                 "metricsFrom": [MONITORING]}})
    policies = only(docs, "NetworkPolicy")
    assert sorted((p["metadata"]["namespace"], p["metadata"]["name"]) for p in policies) == [
        ("serving", "rel-adaserve-redis"), ("serving", "rel-adaserve-workers"),
        ("staging", "rel-adaserve-redis"), ("staging", "rel-adaserve-workers")]
    for p in policies:
        kubernetes_validate.validate(p, KUBE_VERSION, strict=True)
    pods = _pod_labels()
    operator_pod = one(docs, "Deployment")["spec"]["template"]["metadata"]["labels"]
    workers = next(p for p in policies if p["metadata"]["name"].endswith("-workers"))
    redis = next(p for p in policies if p["metadata"]["name"].endswith("-redis"))

    # each policy selects its component's pods and no other (a gateway left open to clients)
    assert [c for c, labels in pods.items() if _selects(workers["spec"]["podSelector"], labels)] == ["worker"]
    assert [c for c, labels in pods.items() if _selects(redis["spec"]["podSelector"], labels)] == ["redis"]
    assert not _selects(workers["spec"]["podSelector"], operator_pod)
    assert workers["spec"]["policyTypes"] == ["Ingress"] == redis["spec"]["policyTypes"]

    (rule,) = workers["spec"]["ingress"]
    assert rule["ports"] == [{"port": names.WORKER_PORT, "protocol": "TCP"}]
    same_namespace = [peer for peer in rule["from"] if set(peer) == {"podSelector"}]
    assert [c for c, labels in pods.items() if any(_selects(p["podSelector"], labels) for p in same_namespace)] == [
        "gateway"]
    assert MONITORING in rule["from"] and len(rule["from"]) == 2  # Prometheus, as asked; nothing else

    (rule,) = redis["spec"]["ingress"]
    assert rule["ports"] == [{"port": names.REDIS_PORT, "protocol": "TCP"}]
    local, operator = rule["from"]
    assert sorted(c for c, labels in pods.items() if _selects(local["podSelector"], labels)) == ["gateway", "worker"]
    # the operator reads the registrations for the status: its pods, in the release's namespace only
    assert operator["namespaceSelector"] == {"matchLabels": {"kubernetes.io/metadata.name": RELEASE_NS}}
    assert _selects(operator["podSelector"], operator_pod)
    assert not any(_selects(operator["podSelector"], labels) for labels in pods.values())


def test_network_policies_go_where_told(render: Render) -> None:
    docs = render({"networkPolicy": {"enabled": True, "namespaces": ["serving"]}})  # all namespaces watched
    assert {p["metadata"]["namespace"] for p in only(docs, "NetworkPolicy")} == {"serving"}
    (rule,) = next(p for p in only(docs, "NetworkPolicy") if p["metadata"]["name"].endswith("-workers"))["spec"][
        "ingress"]
    assert len(rule["from"]) == 1  # no metricsFrom: the gateways only


def test_network_policies_over_all_namespaces_need_a_namespace_list(helm: Path, tmp_path: Path) -> None:
    proc = run_helm(helm, "template", "rel", str(CHART), "--set", "networkPolicy.enabled=true")
    assert proc.returncode != 0
    assert "networkPolicy.enabled needs networkPolicy.namespaces (or watchNamespaces)" in proc.stderr


def test_a_metrics_peer_must_be_a_network_policy_peer(helm: Path, tmp_path: Path) -> None:
    values = tmp_path / "v.yaml"
    values.write_text(yaml.safe_dump({"watchNamespaces": ["s"], "networkPolicy": {
        "enabled": True, "metricsFrom": [{"namespace": "monitoring"}]}}))
    proc = run_helm(helm, "template", "rel", str(CHART), "-f", str(values))
    assert proc.returncode != 0 and "/networkPolicy/metricsFrom/0" in proc.stderr, proc.stderr


def test_secret_reads_only_when_asked_and_the_operator_is_told(render: Render) -> None:
    def secrets(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [r for role in only(docs, "ClusterRole") + only(docs, "Role") for r in role["rules"]
                if "secrets" in r["resources"]]

    def env(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return one(docs, "Deployment")["spec"]["template"]["spec"]["containers"][0].get("env", [])

    for values in ({}, {"watchNamespaces": ["serving"]}):
        assert secrets(render(values)) == [] and env(render(values)) == []
        docs = render({**values, "rbac": {"readSecrets": True}})
        assert secrets(docs) == [{"apiGroups": [""], "resources": ["secrets"], "verbs": ["get"]}]
        assert env(docs) == [{"name": "ADASERVE_OPERATOR_READ_SECRETS", "value": "true"}]
    # beside extraEnv, not instead of it
    extra = [{"name": "ADASERVE_OPERATOR_RESYNC_S", "value": "30"}]
    assert env(render({"rbac": {"readSecrets": True}, "operator": {"extraEnv": extra}}))[1:] == extra
