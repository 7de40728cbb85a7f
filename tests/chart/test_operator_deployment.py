"""The operator Deployment runs the operator with the flags docs/k8s-contract.md fixes, probes kopf's
liveness endpoint and runs locked down (non-root, read-only root filesystem, no capabilities)."""

from __future__ import annotations

from typing import Any

from adaserve.operator.__main__ import kopf_args
from tests.chart.helpers import Render, one

CONTRACT_ARGS_TAIL = ["--peering=adaserve", "--liveness=http://0.0.0.0:8080/healthz"]


def container(docs: list[dict[str, Any]]) -> dict[str, Any]:
    (c,) = one(docs, "Deployment")["spec"]["template"]["spec"]["containers"]
    return c


def test_runs_the_operator_over_all_namespaces_by_default(render: Render) -> None:
    c = container(render())
    assert c["command"] == ["python", "-m", "adaserve.operator"]
    assert c["args"] == ["--all-namespaces", *CONTRACT_ARGS_TAIL]


def test_the_entry_point_turns_the_chart_args_into_the_contract_kopf_command(render: Render) -> None:
    # docs/k8s-contract.md: kopf run --all-namespaces --peering=adaserve -m adaserve.operator.handlers,
    # liveness on :8080/healthz; python -m adaserve.operator adds only a random --priority
    for values in ({}, {"watchNamespaces": ["serving"]}):
        args = kopf_args(container(render(values))["args"])
        assert args[:3] == ["run", "-m", "adaserve.operator.handlers"]
        assert [a for a in args[3:] if not a.startswith("--priority=")] == container(render(values))["args"]


def test_namespace_list_becomes_namespace_flags(render: Render) -> None:
    c = container(render({"watchNamespaces": ["serving", "staging"]}))
    assert c["args"] == ["--namespace=serving", "--namespace=staging", *CONTRACT_ARGS_TAIL]


def test_env_is_only_what_extra_env_adds(render: Render) -> None:
    # the operator reads ADASERVE_OPERATOR_* only (adaserve/operator/config.py); the chart sets none itself
    assert "env" not in container(render())
    extra = [{"name": "ADASERVE_OPERATOR_RESYNC_S", "value": "30"}]
    assert container(render({"operator": {"extraEnv": extra}}))["env"] == extra


def test_log_level_adds_the_kopf_flag(render: Render) -> None:
    assert "--verbose" in container(render({"operator": {"logLevel": "verbose"}}))["args"]
    assert not [a for a in container(render())["args"] if a in ("--quiet", "--verbose", "--debug")]


def test_liveness_probe_hits_kopf_healthz_on_8080(render: Render) -> None:
    c = container(render())
    probe = c["livenessProbe"]["httpGet"]
    assert probe["path"] == "/healthz"
    (port,) = [p for p in c["ports"] if p["name"] == probe["port"]]
    assert port["containerPort"] == 8080
    assert "--liveness=http://0.0.0.0:8080/healthz" in c["args"]


def test_runs_as_non_root_with_read_only_root_filesystem(render: Render) -> None:
    docs = render()
    pod = one(docs, "Deployment")["spec"]["template"]["spec"]
    c = container(docs)
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] != 0
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    assert c["securityContext"]["allowPrivilegeEscalation"] is False
    assert c["securityContext"]["capabilities"]["drop"] == ["ALL"]
    assert {m["mountPath"] for m in c["volumeMounts"]} == {"/tmp"}


def test_has_resource_requests_and_a_memory_limit(render: Render) -> None:
    res = container(render())["resources"]
    assert {"cpu", "memory"} <= set(res["requests"])
    assert "memory" in res["limits"]


def test_one_replica_by_default_and_standbys_on_request(render: Render) -> None:
    assert one(render(), "Deployment")["spec"]["replicas"] == 1
    assert one(render({"operator": {"replicas": 2}}), "Deployment")["spec"]["replicas"] == 2


def test_image_tag_defaults_to_app_version(render: Render) -> None:
    assert container(render())["image"] == "ghcr.io/adaserve/operator:0.1.0"
    c = container(render({"operator": {"image": {"repository": "r/op", "tag": "dev", "pullPolicy": "Never"}}}))
    assert (c["image"], c["imagePullPolicy"]) == ("r/op:dev", "Never")


def test_pod_selector_cannot_match_the_operators_children(render: Render) -> None:
    selector = one(render(), "Deployment")["spec"]["selector"]["matchLabels"]
    assert selector["app.kubernetes.io/component"] == "operator"
    assert "app.kubernetes.io/managed-by" not in selector
