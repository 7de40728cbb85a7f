"""The operator's RBAC is exactly the list in docs/k8s-contract.md ("What the operator may touch"):
nothing missing (the operator would fail at runtime), nothing extra (least privilege)."""

from __future__ import annotations

from typing import Any

import pytest

from tests.chart.helpers import RELEASE_NS, Render, one, only

# docs/k8s-contract.md, transcribed: (apiGroup, resource) -> verbs
NAMESPACED = {
    ("adaserve.io", "adaservedeployments"): {"get", "list", "watch", "patch", "update"},
    ("adaserve.io", "adaservedeployments/status"): {"get", "patch", "update"},
    ("apps", "deployments"): {"get", "list", "watch", "create", "patch", "update", "delete"},
    ("", "services"): {"get", "list", "watch", "create", "patch", "update", "delete"},
    ("", "configmaps"): {"get", "list", "watch", "create", "patch", "update", "delete"},
    ("policy", "poddisruptionbudgets"): {"get", "list", "watch", "create", "patch", "update", "delete"},
    ("", "events"): {"create", "patch"},
    ("kopf.dev", "kopfpeerings"): {"get", "list", "watch", "patch"},
}
CLUSTER_READS = {
    ("apiextensions.k8s.io", "customresourcedefinitions"): {"get", "list", "watch"},
    ("", "namespaces"): {"get", "list", "watch"},
}
CLUSTER_PEERING = {("kopf.dev", "clusterkopfpeerings"): {"get", "list", "watch", "patch"}}
CONTRACT = {**NAMESPACED, **CLUSTER_READS, **CLUSTER_PEERING}


def grants(role: dict[str, Any]) -> dict[tuple[str, str], set[str]]:
    """Flatten rules to (group, resource) -> verbs; a pair granted twice is an error, not a merge."""
    out: dict[tuple[str, str], set[str]] = {}
    for rule in role["rules"]:
        assert set(rule) <= {"apiGroups", "resources", "verbs"}, f"unexpected rule fields: {rule}"
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                assert (group, resource) not in out, f"{group}/{resource} granted twice"
                out[(group, resource)] = set(rule["verbs"])
    return out


def test_all_namespaces_mode_grants_exactly_the_contract_in_one_cluster_role(render: Render) -> None:
    docs = render()
    assert grants(one(docs, "ClusterRole")) == CONTRACT
    assert only(docs, "Role") == [] and only(docs, "RoleBinding") == []


def test_namespace_list_mode_grants_namespaced_rights_only_in_watched_namespaces(render: Render) -> None:
    docs = render({"watchNamespaces": ["serving", "staging"]})
    roles = only(docs, "Role")
    assert sorted(r["metadata"]["namespace"] for r in roles) == ["serving", "staging"]
    for role in roles:
        assert grants(role) == NAMESPACED
    # cluster-wide only what kopf needs to discover resources; kopf peers through KopfPeering here, so the
    # ClusterKopfPeering grant of the all-namespaces mode is left out
    assert grants(one(docs, "ClusterRole")) == CLUSTER_READS


def test_no_wildcards_anywhere(render: Render) -> None:
    for docs in (render(), render({"watchNamespaces": ["serving"]})):
        for role in only(docs, "ClusterRole") + only(docs, "Role"):
            for rule in role["rules"]:
                for field in ("apiGroups", "resources", "verbs"):
                    assert "*" not in rule[field], rule


@pytest.mark.parametrize("values", [{}, {"watchNamespaces": ["serving", "staging"]}], ids=["all", "list"])
def test_every_binding_gives_its_role_to_the_operator_service_account(render: Render, values: dict) -> None:
    docs = render(values)
    sa = one(docs, "ServiceAccount")["metadata"]
    pod = one(docs, "Deployment")["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == sa["name"]
    roles = {(r["kind"], r["metadata"].get("namespace"), r["metadata"]["name"])
             for r in only(docs, "ClusterRole") + only(docs, "Role")}
    bindings = only(docs, "ClusterRoleBinding") + only(docs, "RoleBinding")
    assert len(bindings) == len(roles)
    for b in bindings:
        assert b["subjects"] == [{"kind": "ServiceAccount", "name": sa["name"], "namespace": RELEASE_NS}]
        ns = b["metadata"].get("namespace") if b["roleRef"]["kind"] == "Role" else None
        assert (b["roleRef"]["kind"], ns, b["roleRef"]["name"]) in roles


def test_rbac_create_false_renders_no_rbac(render: Render) -> None:
    docs = render({"rbac": {"create": False}, "watchNamespaces": ["serving"]})
    assert not [d for d in docs if d["apiVersion"].startswith("rbac.authorization.k8s.io/")]


def test_existing_service_account_is_used_when_not_created(render: Render) -> None:
    docs = render({"serviceAccount": {"create": False, "name": "ops"}})
    assert only(docs, "ServiceAccount") == []
    assert one(docs, "Deployment")["spec"]["template"]["spec"]["serviceAccountName"] == "ops"
    assert one(docs, "ClusterRoleBinding")["subjects"][0]["name"] == "ops"
