"""Every way the chart is meant to be installed renders, and every object it renders is valid Kubernetes
for the cluster version we target (strict: unknown fields are errors, as kubectl's server-side check)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest

from tests.chart.helpers import CHART, KUBE_VERSION, RELEASE_NS, Render, one, only, run_helm

SCENARIOS: dict[str, dict[str, Any]] = {
    "defaults": {},
    "service monitors": {"serviceMonitor": {"enabled": True, "labels": {"release": "kube-prometheus-stack"}}},
    "namespace list": {"watchNamespaces": ["serving", "staging"]},
    "everything set": {
        "watchNamespaces": ["serving"],
        "serviceMonitor": {"enabled": True, "interval": "30s", "scrapeTimeout": "20s"},
        "operator": {
            "replicas": 0, "logLevel": "debug", "imagePullSecrets": [{"name": "regcred"}],
            "image": {"repository": "registry.local/adaserve-operator", "tag": "dev", "pullPolicy": "Always"},
            "extraEnv": [{"name": "KOPF_EXTRA", "value": "1"}], "podAnnotations": {"a": "b"},
            "podLabels": {"team": "ml"}, "priorityClassName": "system-cluster-critical",
            "nodeSelector": {"kubernetes.io/os": "linux"},
            "tolerations": [{"key": "dedicated", "operator": "Exists", "effect": "NoSchedule"}],
            "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
                {"matchExpressions": [{"key": "kubernetes.io/arch", "operator": "In", "values": ["amd64"]}]}]}}},
        },
        "serviceAccount": {"annotations": {"iam.gke.io/gcp-service-account": "op@p.iam.gserviceaccount.com"}},
        "rbac": {"readSecrets": True},
        "networkPolicy": {"enabled": True, "metricsFrom": [
            {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}]},
    },
}

# Kinds that are CRDs (no built-in schema): their shape is checked by check_custom below.
CUSTOM_KINDS = {"ServiceMonitor", "KopfPeering", "ClusterKopfPeering"}
DURATION = re.compile(r"^([0-9]+(ms|s|m|h))+$")
DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")


def check_custom(doc: dict[str, Any]) -> None:
    """The parts of the ServiceMonitor / KopfPeering CRDs' schemas that the chart could get wrong."""
    meta = doc["metadata"]
    assert DNS_LABEL.match(meta["name"]) and len(meta["name"]) <= 63
    if doc["kind"] in ("KopfPeering", "ClusterKopfPeering"):
        assert doc["apiVersion"] == "kopf.dev/v1"
        assert ("namespace" in meta) == (doc["kind"] == "KopfPeering")
        assert set(doc) == {"apiVersion", "kind", "metadata"}
        return
    assert doc["apiVersion"] == "monitoring.coreos.com/v1"
    spec = doc["spec"]
    assert set(spec) <= {"selector", "namespaceSelector", "endpoints", "jobLabel"}
    assert set(spec["selector"]) == {"matchLabels"} and spec["selector"]["matchLabels"]
    ns_sel = spec["namespaceSelector"]
    assert ns_sel == {"any": True} or (set(ns_sel) == {"matchNames"} and ns_sel["matchNames"])
    assert spec["endpoints"]
    for ep in spec["endpoints"]:
        assert set(ep) <= {"port", "path", "interval", "scrapeTimeout"}
        assert isinstance(ep["port"], str) and ep["path"].startswith("/")
        assert DURATION.match(ep["interval"]) and DURATION.match(ep["scrapeTimeout"])


@pytest.mark.parametrize("values", SCENARIOS.values(), ids=SCENARIOS.keys())
def test_every_rendered_object_is_valid_kubernetes(render: Render, values: dict[str, Any]) -> None:
    docs = render(values, crds=True)
    assert docs
    for doc in docs:
        if doc["kind"] in CUSTOM_KINDS:
            check_custom(doc)
        else:
            kubernetes_validate.validate(doc, KUBE_VERSION, strict=True)


@pytest.mark.parametrize("values", SCENARIOS.values(), ids=SCENARIOS.keys())
def test_objects_are_named_after_the_release_and_live_where_they_act(render: Render, values: dict) -> None:
    watched = values.get("watchNamespaces", [])
    for doc in render(values):
        meta = doc["metadata"]
        if doc["kind"] in ("Role", "RoleBinding", "KopfPeering", "NetworkPolicy"):
            assert meta["namespace"] in watched
        elif doc["kind"] in ("ClusterRole", "ClusterRoleBinding", "ClusterKopfPeering"):
            assert "namespace" not in meta
        else:
            assert meta["namespace"] == RELEASE_NS
        if not doc["kind"].endswith("KopfPeering"):  # named by operator.peering, which kopf's --peering uses
            assert meta["name"].startswith("rel-adaserve")
        assert meta["labels"]["app.kubernetes.io/managed-by"] == "Helm"


def test_service_monitors_only_when_enabled(render: Render) -> None:
    assert only(render(), "ServiceMonitor") == []
    docs = render({"serviceMonitor": {"enabled": True, "gateway": {"enabled": False}}})
    assert [m["metadata"]["name"] for m in only(docs, "ServiceMonitor")] == ["rel-adaserve-worker"]


@pytest.mark.parametrize("component", ["worker", "gateway"])
def test_service_monitor_scrapes_the_operators_children_by_contract_labels(render: Render, component: str) -> None:
    docs = render({"serviceMonitor": {"enabled": True, "labels": {"release": "prom"}}})
    (mon,) = [m for m in only(docs, "ServiceMonitor") if m["metadata"]["name"] == f"rel-adaserve-{component}"]
    # the labels docs/k8s-contract.md puts on every child the operator creates
    assert mon["spec"]["selector"]["matchLabels"] == {
        "app.kubernetes.io/name": "adaserve",
        "app.kubernetes.io/component": component,
        "app.kubernetes.io/managed-by": "adaserve-operator",
    }
    assert mon["spec"]["namespaceSelector"] == {"any": True}
    assert mon["spec"]["endpoints"] == [{"port": "http", "path": "/metrics", "interval": "15s", "scrapeTimeout": "10s"}]
    assert mon["metadata"]["labels"]["release"] == "prom"


def test_service_monitors_look_only_in_watched_namespaces(render: Render) -> None:
    docs = render({"serviceMonitor": {"enabled": True}, "watchNamespaces": ["serving", "staging"]})
    for mon in only(docs, "ServiceMonitor"):
        assert mon["spec"]["namespaceSelector"] == {"matchNames": ["serving", "staging"]}


def test_peering_object_matches_the_mode(render: Render) -> None:
    assert one(render(), "ClusterKopfPeering")["metadata"]["name"] == "adaserve"
    assert only(render(), "KopfPeering") == []
    docs = render({"watchNamespaces": ["serving", "staging"]})
    assert only(docs, "ClusterKopfPeering") == []
    assert sorted(p["metadata"]["namespace"] for p in only(docs, "KopfPeering")) == ["serving", "staging"]


def test_clusters_older_than_1_29_are_refused(helm: Path) -> None:
    # the CRD's validation rules are CEL (x-kubernetes-validations), GA only from 1.29
    proc = run_helm(helm, "template", "rel", str(CHART), "--kube-version", "1.28.9")
    assert proc.returncode != 0 and "kubeVersion" in proc.stderr


@pytest.mark.parametrize("values", [[], ["--set", "watchNamespaces={serving}", "--set", "serviceMonitor.enabled=true"]],
                         ids=["defaults", "namespaces+monitors"])
def test_notes_give_the_next_steps(helm: Path, values: list[str]) -> None:
    proc = run_helm(helm, "install", "adaserve", str(CHART), "-n", RELEASE_NS, "--dry-run=client", *values)
    assert proc.returncode == 0, proc.stderr
    notes = proc.stdout.split("NOTES:", 1)[1]
    for step in ("rollout status deployment/adaserve-operator", "kubectl apply", "get asd",
                 "port-forward svc/llama-gateway", "X-SLO-Class", "kubectl apply --server-side"):
        assert step in notes
