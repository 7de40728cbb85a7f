"""Small pure pieces: drift detection, API paths, config, the entry point's flags (no torch: tests/test_imports.py)."""

from __future__ import annotations

import asyncio
import base64
from pathlib import Path

import kopf
import pytest

from adaserve.operator import handlers
from adaserve.operator.__main__ import kopf_args
from adaserve.operator.config import OperatorConfig
from adaserve.operator.kube import Kube, is_subset, path, removals
from adaserve.operator.spec import SpecError, parse_spec


def test_is_subset_ignores_server_defaults_but_not_changes() -> None:
    desired = {"spec": {"replicas": 2, "template": {"spec": {"initContainers": [], "containers": [
        {"name": "w", "env": [{"name": "A", "value": "1"}]}]}}}}
    live = {"metadata": {"uid": "u"}, "spec": {"replicas": 2, "strategy": {"type": "RollingUpdate"}, "template": {
        "spec": {"dnsPolicy": "ClusterFirst", "containers": [
            {"name": "w", "env": [{"name": "A", "value": "1"}], "terminationMessagePath": "/dev/termination-log"}]}}}}
    assert is_subset(desired, live)  # added defaults and a dropped empty list are no drift
    desired["spec"]["replicas"] = 3
    assert not is_subset(desired, live)
    desired["spec"]["replicas"] = 2
    desired["spec"]["template"]["spec"]["containers"][0]["env"].append({"name": "B", "value": "2"})
    assert not is_subset(desired, live)  # a list with another length is drift
    assert not is_subset({"data": {"k": "1"}}, {"data": {"k": 1}})


def test_api_paths() -> None:
    assert path("apps/v1", "Deployment", "ns", "x") == "/apis/apps/v1/namespaces/ns/deployments/x"
    assert path("v1", "ConfigMap", "ns") == "/api/v1/namespaces/ns/configmaps"
    assert path("adaserve.io/v1alpha1", "AdaServeDeployment", "ns", "a") == (
        "/apis/adaserve.io/v1alpha1/namespaces/ns/adaservedeployments/a")


def test_config_from_env() -> None:
    assert OperatorConfig.from_env({}) == OperatorConfig(resync_s=15.0, redis_timeout_s=1.0)
    assert OperatorConfig.from_env({"ADASERVE_OPERATOR_RESYNC_S": "2.5"}).resync_s == 2.5
    with pytest.raises(ValueError, match="resync_s must be > 0"):
        OperatorConfig.from_env({"ADASERVE_OPERATOR_RESYNC_S": "0"})
    with pytest.raises(ValueError, match="ADASERVE_OPERATOR_"):
        OperatorConfig.from_env({"ADASERVE_OPERATOR_REDIS_TIMEOUT_S": "soon"})


def test_the_resync_timer_first_runs_one_interval_after_create(monkeypatch: pytest.MonkeyPatch) -> None:
    # kopf runs a timer with no initial_delay as soon as it spawns it, right after create/resume's reconcile
    seen: dict[str, object] = {}
    timer = kopf.timer

    def spy(*args: object, **kwargs: object) -> object:
        seen.update(kwargs)
        return timer(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(kopf, "timer", spy)
    handlers.register(kopf.OperatorRegistry(), OperatorConfig(resync_s=7.0))
    assert seen["interval"] == seen["initial_delay"] == 7.0


def test_entry_point_defaults_and_overrides() -> None:
    args = kopf_args([])
    assert args[:5] == ["run", "-m", "adaserve.operator.handlers", "--all-namespaces", "--peering=adaserve"]
    assert args[5] == "--liveness=http://0.0.0.0:8080/healthz" and args[6].startswith("--priority=")
    assert kopf_args(["-n", "serving", "--standalone"]) == [
        "run", "-m", "adaserve.operator.handlers", "--liveness=http://0.0.0.0:8080/healthz", "-n", "serving",
        "--standalone"]


def test_spec_error_names_the_field() -> None:
    good = {"model": {"target": "/t", "draft": "/d"}, "image": "w", "gateway": {"image": "g"},
            "redis": {"managed": True}, "sloClasses": [{"name": "a", "tpotMs": 5}]}
    with pytest.raises(SpecError) as e:
        parse_spec({**good, "sloClasses": [{"name": "a", "tpotMs": 5}, {"name": "b"}]})
    assert (e.value.path, e.value.message) == ("spec.sloClasses[1].tpotMs", "required")
    assert isinstance(e.value, ValueError) and str(e.value) == "spec.sloClasses[1].tpotMs: required"
    with pytest.raises(SpecError, match=r"^spec\.replicas: Input should be a valid integer"):
        parse_spec({**good, "replicas": "2"})  # strict, as the API server: "2" is no integer
    with pytest.raises(SpecError, match=r"^spec\.model: required"):
        parse_spec(None)



def test_removals_null_what_the_spec_dropped_from_whole_maps_only() -> None:
    """A merge patch merges maps: a nodeSelector key or an affinity term the spec dropped would stay on the live pods
    unless the patch names it null. Lists (tolerations, env) are replaced whole by the patch anyway; server defaults
    outside the pod template's whole maps and kubectl's own annotations are left alone."""
    desired = {"spec": {"template": {"metadata": {"labels": {"app": "a"}, "annotations": {"x": "1"}},
                                     "spec": {"nodeSelector": {"pool": "h100"}, "affinity": {"nodeAffinity": {"a": 1}},
                                              "tolerations": []}}}}
    live = {"spec": {"progressDeadlineSeconds": 600, "template": {
        "metadata": {"labels": {"app": "a", "team": "old"},
                     "annotations": {"x": "1", "y": "2", "kubectl.kubernetes.io/restartedAt": "now"}},
        "spec": {"nodeSelector": {"pool": "h100", "zone": "b"}, "dnsPolicy": "ClusterFirst",
                 "affinity": {"nodeAffinity": {"a": 1, "b": 2}, "podAntiAffinity": {"c": 3}},
                 "tolerations": [{"key": "k"}]}}}}
    assert removals(desired, live) == {"spec": {"template": {
        "metadata": {"labels": {"team": None}, "annotations": {"y": None}},
        "spec": {"nodeSelector": {"zone": None}, "affinity": {"nodeAffinity": {"b": None}, "podAntiAffinity": None}}}}}
    assert removals(live, live) == {}
    # a map the spec no longer has at all is a null in the manifest itself (builders render it so), not here
    assert removals({"spec": {"template": {"spec": {"nodeSelector": None}}}}, live) == {}


def test_kopfs_login_becomes_the_clients_configuration() -> None:
    """kopf's ConnectionInfo (a pod's service account or a kubeconfig) as kubernetes_asyncio's Configuration: the
    token with its scheme, a CA and client certificate given as data written to files, TLS checks unless insecure."""
    pem = base64.b64encode(b"-----BEGIN CERTIFICATE-----\n").decode()
    kube = Kube()
    cfg = kube._configuration(kopf.ConnectionInfo(server="https://k8s.example:6443/", token="tok", ca_data=pem,
                                                  certificate_data=pem, private_key_data=pem))
    try:
        assert cfg.host == "https://k8s.example:6443" and cfg.verify_ssl
        assert cfg.api_key == {"BearerToken": "tok"} and cfg.api_key_prefix == {"BearerToken": "Bearer"}
        for path in (cfg.ssl_ca_cert, cfg.cert_file, cfg.key_file):
            assert Path(path).read_bytes() == b"-----BEGIN CERTIFICATE-----\n"
        insecure = kube._configuration(kopf.ConnectionInfo(server="https://k", insecure=True, ca_path="/ca.pem"))
        assert not insecure.verify_ssl and insecure.ssl_ca_cert == "/ca.pem" and insecure.api_key == {}
    finally:
        asyncio.run(kube.close())
    assert not Path(cfg.ssl_ca_cert).exists()  # the credentials files go with the client
