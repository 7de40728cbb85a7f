"""Pure builders: the example spec renders into exactly these objects (docs/k8s-contract.md), and each
variant (hub, hub token, image, CPU, fixed budget, API keys, external Redis) changes exactly what it should."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest
import yaml

from adaserve.operator import builders
from adaserve.operator.kube import is_subset
from adaserve.operator.spec import DeploymentSpec, SpecError, parse_spec
from tests.operator.schema import EXAMPLE_PATH, FULL_POD

NS, NAME = "serving", "llama"
CLASSES_ENV = '{"coding": 40, "chat": 50, "summarization": 150}'  # {"class": tpotMs}, as the worker reads it
CLASSES_FILE = "/etc/adaserve/slo/slo-classes.json"


@pytest.fixture
def raw() -> dict[str, Any]:
    return yaml.safe_load(EXAMPLE_PATH.read_text())["spec"]


@pytest.fixture
def spec(raw: dict[str, Any]) -> DeploymentSpec:
    return parse_spec(raw)


def sel(component: str) -> dict[str, str]:
    return {"app.kubernetes.io/name": "adaserve", "app.kubernetes.io/instance": NAME,
            "app.kubernetes.io/component": component}


def labels(component: str) -> dict[str, str]:
    return {**sel(component), "app.kubernetes.io/managed-by": "adaserve-operator", "adaserve.io/component": component}


def meta(name: str, component: str) -> dict[str, Any]:
    return {"name": name, "namespace": NS, "labels": labels(component)}


def service(component: str, port: int, *, port_name: str = "http", type_: str = "ClusterIP") -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": meta(f"llama-{component}", component),
        "spec": {"type": type_, "selector": sel(component),
                 "ports": [{"name": port_name, "port": port, "targetPort": port_name, "protocol": "TCP"}]},
    }


def http_probes(**extra: Any) -> dict[str, Any]:
    return {
        **extra,
        "livenessProbe": {"httpGet": {"path": "/healthz", "port": "http"}, "periodSeconds": 10, "failureThreshold": 3},
        "readinessProbe": {"httpGet": {"path": "/readyz", "port": "http"}, "periodSeconds": 5, "failureThreshold": 2},
    }


# the pod fields a spec's workerPod / gateway.pod may set, as rendered when it sets none: present, so that a merge
# patch also removes them when the spec drops them
NO_OVERRIDE = {"nodeSelector": None, "tolerations": [], "affinity": None, "topologySpreadConstraints": [],
               "imagePullSecrets": [], "priorityClassName": None, "runtimeClassName": None, "serviceAccountName": None}
GATEWAY_RESOURCES = {"requests": {"cpu": "250m", "memory": "256Mi"}, "limits": {"memory": "1Gi"}}


def env_of(deployment: dict[str, Any], container: int = 0) -> dict[str, Any]:
    env = deployment["spec"]["template"]["spec"]["containers"][container]["env"]
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in env}


def test_children_names_and_order(spec: DeploymentSpec) -> None:
    kinds = [(c["kind"], c["metadata"]["name"]) for c in builders.children(spec, name=NAME, namespace=NS)]
    assert kinds == [("ConfigMap", "llama-slo-classes"), ("Deployment", "llama-redis"), ("Service", "llama-redis"),
                     ("Deployment", "llama-worker"), ("Service", "llama-worker"),
                     ("Deployment", "llama-gateway"), ("Service", "llama-gateway")]


def test_slo_configmap(spec: DeploymentSpec) -> None:
    cm = builders.slo_configmap(spec, name=NAME, namespace=NS)
    assert cm == {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": "llama-slo-classes", "namespace": NS,
                     "labels": {"app.kubernetes.io/name": "adaserve", "app.kubernetes.io/instance": NAME,
                                "app.kubernetes.io/managed-by": "adaserve-operator"}},
        "data": {"slo-classes.json": cm["data"]["slo-classes.json"]},
    }
    assert json.loads(cm["data"]["slo-classes.json"]) == [
        {"name": "coding", "tpotMs": 40, "ttftMs": 1000, "priority": 10, "sheddable": False},
        {"name": "chat", "tpotMs": 50, "priority": 0, "sheddable": False},
        {"name": "summarization", "tpotMs": 150, "priority": -1, "sheddable": True},
    ]


def test_worker_deployment(spec: DeploymentSpec) -> None:
    assert builders.worker_deployment(spec, name=NAME, namespace=NS) == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": meta("llama-worker", "worker"),
        "spec": {
            "replicas": 2,
            "selector": {"matchLabels": sel("worker")},
            "template": {
                "metadata": {"labels": labels("worker")},
                "spec": {
                    "terminationGracePeriodSeconds": 45,
                    "initContainers": [],
                    "containers": [{
                        "name": "worker",
                        "image": "ghcr.io/adaserve/worker:0.1.0",
                        "command": ["adaserve", "worker"],
                        "ports": [{"name": "http", "containerPort": 8000, "protocol": "TCP"}],
                        "env": [
                            {"name": "ADASERVE_TARGET", "value": "/models/llama-3.1-8b-instruct"},
                            {"name": "ADASERVE_DRAFT", "value": "/models/llama-3.2-1b-instruct"},
                            {"name": "ADASERVE_MODEL_NAME", "value": "llama-3.1-8b"},
                            {"name": "ADASERVE_DTYPE", "value": "bfloat16"},
                            {"name": "ADASERVE_DEVICE", "value": "cuda"},
                            {"name": "ADASERVE_POLICY", "value": "adaserve"},
                            {"name": "ADASERVE_MAX_DEPTH", "value": "4"},
                            {"name": "ADASERVE_MAX_WIDTH", "value": "2"},
                            {"name": "ADASERVE_HOST", "value": "0.0.0.0"},
                            {"name": "ADASERVE_PORT", "value": "8000"},
                            {"name": "ADASERVE_WORKER_ID", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
                            {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
                            {"name": "ADASERVE_ADVERTISE_URL", "value": "http://$(POD_IP):8000"},
                            {"name": "ADASERVE_REDIS_URL", "value": "redis://llama-redis.serving.svc:6379/0"},
                            {"name": "ADASERVE_REDIS_PREFIX", "value": "adaserve:serving:llama"},
                            {"name": "ADASERVE_SLO_CLASSES", "value": CLASSES_ENV},
                            {"name": "ADASERVE_DEFAULT_SLO_CLASS", "value": "chat"},
                            {"name": "ADASERVE_CACHE_DIR", "value": "/var/cache/adaserve"},
                            {"name": "ADASERVE_DRAIN_GRACE_S", "value": "30"},
                        ],
                        "resources": {
                            "requests": {"cpu": "8", "memory": "64Gi", "nvidia.com/gpu": "1"},
                            "limits": {"memory": "64Gi", "nvidia.com/gpu": "1"},
                        },
                        "volumeMounts": [{"name": "cache", "mountPath": "/var/cache/adaserve"},
                                         {"name": "models", "mountPath": "/models", "readOnly": True}],
                        # 180 x 10 s = 30 min to load and profile before the kubelet gives up
                        "startupProbe": {"httpGet": {"path": "/readyz", "port": "http"},
                                         "periodSeconds": 10, "failureThreshold": 180},
                        **http_probes(),
                    }],
                    "volumes": [{"name": "cache", "emptyDir": {}},
                                {"name": "models", "persistentVolumeClaim": {"claimName": "models", "readOnly": True}}],
                    **NO_OVERRIDE,
                },
            },
        },
    }


def test_worker_service(spec: DeploymentSpec) -> None:
    assert builders.worker_service(name=NAME, namespace=NS) == service("worker", 8000)


def test_gateway_deployment(spec: DeploymentSpec) -> None:
    d = builders.gateway_deployment(spec, name=NAME, namespace=NS)
    digest = d["spec"]["template"]["metadata"]["annotations"]["adaserve.io/slo-classes-sha256"]
    assert len(digest) == 16
    assert d == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": meta("llama-gateway", "gateway"),
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": sel("gateway")},
            "template": {
                "metadata": {"labels": labels("gateway"), "annotations": {"adaserve.io/slo-classes-sha256": digest}},
                "spec": {
                    "containers": [{
                        "name": "gateway",
                        "image": "ghcr.io/adaserve/gateway:0.1.0",
                        "command": ["python", "-m", "adaserve.gateway"],
                        "ports": [{"name": "http", "containerPort": 8080, "protocol": "TCP"}],
                        "env": [
                            {"name": "ADASERVE_GATEWAY_HOST", "value": "0.0.0.0"},
                            {"name": "ADASERVE_GATEWAY_PORT", "value": "8080"},
                            {"name": "ADASERVE_GATEWAY_REDIS_URL", "value": "redis://llama-redis.serving.svc:6379/0"},
                            {"name": "ADASERVE_GATEWAY_REDIS_PREFIX", "value": "adaserve:serving:llama"},
                            {"name": "ADASERVE_GATEWAY_MODEL_NAME", "value": "llama-3.1-8b"},
                            {"name": "ADASERVE_GATEWAY_SLO_CLASSES_FILE", "value": CLASSES_FILE},
                            {"name": "ADASERVE_GATEWAY_DEFAULT_SLO_CLASS", "value": "chat"},
                            {"name": "ADASERVE_GATEWAY_ROUTING", "value": "headroom"},
                        ],
                        "resources": GATEWAY_RESOURCES,
                        "volumeMounts": [{"name": "slo-classes", "mountPath": "/etc/adaserve/slo", "readOnly": True}],
                        **http_probes(),
                    }],
                    "volumes": [{"name": "slo-classes", "configMap": {"name": "llama-slo-classes"}}],
                    **NO_OVERRIDE,
                },
            },
        },
    }


def test_gateway_rolls_when_classes_change(raw: dict[str, Any]) -> None:
    def digest(r: dict[str, Any]) -> str:
        d = builders.gateway_deployment(parse_spec(r), name=NAME, namespace=NS)
        return str(d["spec"]["template"]["metadata"]["annotations"]["adaserve.io/slo-classes-sha256"])

    before = digest(raw)
    assert digest(copy.deepcopy(raw)) == before  # deterministic
    raw["sloClasses"][1]["tpotMs"] = 60
    assert digest(raw) != before


def test_gateway_service(raw: dict[str, Any]) -> None:
    raw["gateway"].update(serviceType="LoadBalancer", port=8443)
    assert builders.gateway_service(parse_spec(raw), name=NAME, namespace=NS) == service(
        "gateway", 8443, type_="LoadBalancer")


def test_gateway_api_keys_secret_is_mounted(raw: dict[str, Any]) -> None:
    raw["gateway"]["apiKeysSecret"] = {"name": "keys"}
    pod = builders.gateway_deployment(parse_spec(raw), name=NAME, namespace=NS)["spec"]["template"]["spec"]
    c = pod["containers"][0]
    assert c["env"][-1] == {"name": "ADASERVE_GATEWAY_API_KEYS_FILE", "value": "/etc/adaserve/api-keys/api-keys.json"}
    assert c["volumeMounts"][-1] == {"name": "api-keys", "mountPath": "/etc/adaserve/api-keys", "readOnly": True}
    assert pod["volumes"][-1] == {"name": "api-keys", "secret": {"secretName": "keys"}}


def test_managed_redis(spec: DeploymentSpec) -> None:
    assert builders.redis_deployment(spec, name=NAME, namespace=NS) == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": meta("llama-redis", "redis"),
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": sel("redis")},
            "template": {"metadata": {"labels": labels("redis")}, "spec": {"containers": [{
                "name": "redis",
                "image": "redis:7-alpine",
                "args": ["--save", "", "--appendonly", "no"],
                "env": [],
                "ports": [{"name": "redis", "containerPort": 6379, "protocol": "TCP"}],
                "livenessProbe": {"tcpSocket": {"port": "redis"}, "periodSeconds": 10},
                "readinessProbe": {"exec": {"command": ["redis-cli", "ping"]}, "periodSeconds": 5},
            }]}},
            "strategy": {"type": "Recreate"},
        },
    }
    assert builders.redis_service(name=NAME, namespace=NS) == service("redis", 6379, port_name="redis")


def test_external_redis_has_no_redis_children_and_its_url_everywhere(raw: dict[str, Any]) -> None:
    raw["redis"] = {"url": "redis://shared-redis:6379/2"}
    kids = builders.children(parse_spec(raw), name=NAME, namespace=NS)
    assert not [c for c in kids if c["metadata"]["name"] == "llama-redis"]
    worker, gateway = (next(c for c in kids if c["metadata"]["name"] == n and c["kind"] == "Deployment")
                       for n in ("llama-worker", "llama-gateway"))
    assert env_of(worker)["ADASERVE_REDIS_URL"] == "redis://shared-redis:6379/2"
    assert env_of(gateway)["ADASERVE_GATEWAY_REDIS_URL"] == "redis://shared-redis:6379/2"


def hub_pod(raw: dict[str, Any], **hub: Any) -> dict[str, Any]:
    del raw["model"]["pvc"]
    raw["model"].update(source="hub", target="meta-llama/Llama-3.1-8B-Instruct", draft="meta-llama/Llama-3.2-1B")
    if hub:
        raw["model"]["hub"] = hub
    return dict(builders.worker_deployment(parse_spec(raw), name=NAME, namespace=NS)["spec"]["template"]["spec"])


def test_hub_models_are_fetched_by_an_init_container(raw: dict[str, Any]) -> None:
    pod = hub_pod(raw)
    assert pod["initContainers"] == [{
        "name": "adaserve-fetch",
        "image": "ghcr.io/adaserve/worker:0.1.0",
        "command": ["sh", "-c",
                    "hf download meta-llama/Llama-3.1-8B-Instruct"
                    " --local-dir /models/meta-llama/Llama-3.1-8B-Instruct && "
                    "hf download meta-llama/Llama-3.2-1B --local-dir /models/meta-llama/Llama-3.2-1B"],
        "env": [],  # no token: public models
        "volumeMounts": [{"name": "models", "mountPath": "/models"}],
    }]
    assert pod["volumes"][1] == {"name": "models", "emptyDir": {}}
    env = {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}
    assert env["ADASERVE_TARGET"] == "/models/meta-llama/Llama-3.1-8B-Instruct"
    assert env["ADASERVE_DRAFT"] == "/models/meta-llama/Llama-3.2-1B"


@pytest.mark.parametrize(("token_secret", "ref"), [
    ({"name": "hf-token"}, {"name": "hf-token", "key": "token"}),  # the key's default
    ({"name": "hf", "key": "HF_TOKEN"}, {"name": "hf", "key": "HF_TOKEN"}),
])
def test_hub_token_goes_to_the_fetcher_only(raw: dict[str, Any], token_secret: dict[str, str],
                                            ref: dict[str, str]) -> None:
    pod = hub_pod(raw, tokenSecret=token_secret)
    (fetch,) = pod["initContainers"]
    assert fetch["env"] == [{"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": ref}}]
    # the worker loads local files only: it never needs the token, so it never sees it
    assert not any(e["name"] == "HF_TOKEN" for e in pod["containers"][0]["env"])


def test_hub_without_token_secret_is_like_no_hub_settings(raw: dict[str, Any]) -> None:
    assert hub_pod(copy.deepcopy(raw), tokenSecret=None) == hub_pod(copy.deepcopy(raw))


def test_removing_the_hub_token_is_drift_the_operator_repairs(raw: dict[str, Any]) -> None:
    with_token = hub_pod(copy.deepcopy(raw), tokenSecret={"name": "hf-token"})
    without = hub_pod(copy.deepcopy(raw))
    # Kube.apply patches only when the desired object is not a subset of the live one
    assert not is_subset(without, with_token)
    assert not is_subset(with_token, without)


def test_image_source_cpu_fixed_budget_no_draft(raw: dict[str, Any]) -> None:
    del raw["model"]["pvc"], raw["model"]["draft"], raw["model"]["name"], raw["defaultSloClass"]
    raw["model"].update(source="image", target="/opt/model")
    raw["resources"] = {"gpusPerWorker": 0}
    raw["speculation"] = {"policy": "incremental", "budget": 32}
    d = builders.worker_deployment(parse_spec(raw), name=NAME, namespace=NS)
    pod = d["spec"]["template"]["spec"]
    assert pod["initContainers"] == [] and pod["volumes"] == [{"name": "cache", "emptyDir": {}}]
    assert pod["containers"][0]["resources"] == {"requests": {}, "limits": {}}
    env = env_of(d)
    assert "ADASERVE_DRAFT" not in env
    assert (env["ADASERVE_DEVICE"], env["ADASERVE_BUDGET"], env["ADASERVE_POLICY"]) == ("cpu", "32", "incremental")
    assert env["ADASERVE_MODEL_NAME"] == NAME  # defaults to the resource's name
    assert env["ADASERVE_DEFAULT_SLO_CLASS"] == "coding"  # the first class when none is named


def test_budget_auto_leaves_the_variable_unset(spec: DeploymentSpec) -> None:
    assert "ADASERVE_BUDGET" not in env_of(builders.worker_deployment(spec, name=NAME, namespace=NS))


def test_builders_do_not_share_state(spec: DeploymentSpec) -> None:
    a = builders.children(spec, name=NAME, namespace=NS)
    a[3]["spec"]["template"]["spec"]["containers"][0]["env"].clear()
    assert builders.children(spec, name=NAME, namespace=NS) != a


def test_kv_memory_fraction_reaches_the_worker(raw: dict[str, Any]) -> None:
    assert "ADASERVE_KV_MEMORY_FRACTION" not in env_of(builders.worker_deployment(parse_spec(raw), name=NAME,
                                                                                    namespace=NS))
    raw.setdefault("resources", {})["kvMemoryFraction"] = 0.85
    env = env_of(builders.worker_deployment(parse_spec(raw), name=NAME, namespace=NS))
    assert env["ADASERVE_KV_MEMORY_FRACTION"] == "0.85"
    raw["resources"]["kvMemoryFraction"] = 1.5
    with pytest.raises(SpecError, match="kvMemoryFraction"):
        parse_spec(raw)


def test_a_pod_override_reaches_the_worker_pod_beside_the_operators_own(raw: dict[str, Any]) -> None:
    raw["workerPod"] = copy.deepcopy(FULL_POD)
    d = builders.worker_deployment(parse_spec(raw), name=NAME, namespace=NS)
    template = d["spec"]["template"]
    pod = template["spec"]
    assert template["metadata"]["labels"] == {"team": "search", **labels("worker")}
    assert template["metadata"]["annotations"] == {"sidecar.istio.io/inject": "false"}
    for field in ("nodeSelector", "affinity", "topologySpreadConstraints", "imagePullSecrets", "priorityClassName",
                  "runtimeClassName", "serviceAccountName"):
        assert pod[field] == FULL_POD[field], field
    assert pod["tolerations"] == FULL_POD["tolerations"]
    (c,) = pod["containers"]
    assert c["env"][-3:] == FULL_POD["env"]  # after the operator's, which they cannot name
    assert env_of(d)["ADASERVE_POLICY"] == "adaserve"
    assert pod["volumes"][:2] == [{"name": "cache", "emptyDir": {}},
                                  {"name": "models", "persistentVolumeClaim": {"claimName": "models",
                                                                               "readOnly": True}}]
    assert pod["volumes"][2:] == FULL_POD["volumes"]
    assert c["volumeMounts"][2:] == [{"name": "data", "mountPath": "/data", "readOnly": True},
                                     {"name": "certs", "mountPath": "/certs", "readOnly": False, "subPath": "tls"}]
    # the selector is the operator's alone: an override's labels never change which pods the Deployment owns
    assert d["spec"]["selector"] == {"matchLabels": sel("worker")}
    # and the gateway is untouched by the workers' override
    gw = builders.gateway_deployment(parse_spec(raw), name=NAME, namespace=NS)["spec"]["template"]
    assert all(gw["spec"][k] == v for k, v in NO_OVERRIDE.items())
    assert gw["metadata"]["labels"] == labels("gateway")


def test_the_gateway_gets_its_own_override_and_resources(raw: dict[str, Any]) -> None:
    raw["gateway"]["pod"] = {"imagePullSecrets": [{"name": "registry"}], "tolerations": [
        {"key": "dedicated", "value": "edge", "effect": "NoSchedule"}], "env": [
        {"name": "ADASERVE_GATEWAY_QUEUE_TIMEOUT_S", "value": "5"}], "annotations": {"a": "b"}}
    raw["gateway"]["resources"] = {"requests": {"cpu": 1, "memory": "512Mi"}, "limits": {"cpu": "2", "memory": "2Gi"}}
    d = builders.gateway_deployment(parse_spec(raw), name=NAME, namespace=NS)
    pod = d["spec"]["template"]["spec"]
    assert pod["imagePullSecrets"] == [{"name": "registry"}]
    assert pod["tolerations"] == [{"key": "dedicated", "operator": "Equal", "value": "edge", "effect": "NoSchedule"}]
    assert env_of(d)["ADASERVE_GATEWAY_QUEUE_TIMEOUT_S"] == "5"
    # quantities as strings, as the API server returns them (an int would read as drift on every resync)
    assert pod["containers"][0]["resources"] == {"requests": {"cpu": "1", "memory": "512Mi"},
                                                 "limits": {"cpu": "2", "memory": "2Gi"}}
    annotations = d["spec"]["template"]["metadata"]["annotations"]
    assert annotations["a"] == "b" and "adaserve.io/slo-classes-sha256" in annotations


def test_extra_resources_kv_memory_and_shm_without_tensor_parallelism(raw: dict[str, Any]) -> None:
    raw["resources"].update(requests={"ephemeral-storage": "50Gi", "rdma/ib": 1}, limits={"rdma/ib": 1},
                            kvMemory="16Gi", shmSize="2Gi")
    d = builders.worker_deployment(parse_spec(raw), name=NAME, namespace=NS)
    c = d["spec"]["template"]["spec"]["containers"][0]
    assert c["resources"] == {
        "requests": {"cpu": "8", "memory": "64Gi", "nvidia.com/gpu": "1", "ephemeral-storage": "50Gi", "rdma/ib": "1"},
        "limits": {"memory": "64Gi", "nvidia.com/gpu": "1", "rdma/ib": "1"}}
    assert env_of(d)["ADASERVE_KV_MEMORY_MB"] == str(16 * 1024)
    assert c["command"] == ["adaserve", "worker"]  # one rank: shared memory asked for, no flag
    assert {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": "2Gi"}} in d["spec"]["template"]["spec"][
        "volumes"]
    assert {"name": "shm", "mountPath": "/dev/shm"} in c["volumeMounts"]


@pytest.mark.parametrize(("budget", "field"), [({"maxUnavailable": 1}, ("maxUnavailable", 1)),
                                               ({"minAvailable": "50%"}, ("minAvailable", "50%"))])
def test_a_disruption_budget_covers_the_worker_pods(raw: dict[str, Any], budget: dict[str, Any],
                                                    field: tuple[str, Any]) -> None:
    assert [c["kind"] for c in builders.children(parse_spec(raw), name=NAME, namespace=NS)].count(
        "PodDisruptionBudget") == 0  # none unless asked for
    raw["disruptionBudget"] = budget
    children = builders.children(parse_spec(raw), name=NAME, namespace=NS)
    assert children[-1] == {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": meta("llama-worker", "worker"),
        "spec": {"selector": {"matchLabels": sel("worker")}, field[0]: field[1]},
    }
    worker = next(c for c in children if c["kind"] == "Deployment" and c["metadata"]["name"] == "llama-worker")
    assert worker["spec"]["selector"]["matchLabels"] == children[-1]["spec"]["selector"]["matchLabels"]


def test_redis_password_reaches_every_service_from_its_secret(raw: dict[str, Any]) -> None:
    raw["redis"]["passwordSecret"] = {"name": "redis-auth"}
    spec = parse_spec(raw)
    ref = {"secretKeyRef": {"name": "redis-auth", "key": "password"}}
    worker = builders.worker_deployment(spec, name=NAME, namespace=NS)
    gateway = builders.gateway_deployment(spec, name=NAME, namespace=NS)
    assert env_of(worker)["ADASERVE_REDIS_PASSWORD"] == ref
    assert env_of(gateway)["ADASERVE_GATEWAY_REDIS_PASSWORD"] == ref
    # the URL stays password-free: it is in the pods' env in clear, and in the operator's logs
    assert "@" not in env_of(worker)["ADASERVE_REDIS_URL"]
    (redis,) = builders.redis_deployment(spec, name=NAME, namespace=NS)["spec"]["template"]["spec"]["containers"]
    assert redis["args"][-2:] == ["--requirepass", "$(REDIS_PASSWORD)"]
    assert redis["env"] == [{"name": "REDIS_PASSWORD", "valueFrom": ref}, {"name": "REDISCLI_AUTH", "valueFrom": ref}]


def test_an_external_redis_with_an_acl_user_and_a_private_ca(raw: dict[str, Any]) -> None:
    raw["redis"] = {"url": "rediss://redis.example:6380/0", "passwordSecret": {"name": "r", "key": "pw"},
                    "username": "adaserve", "tls": {"caSecret": {"name": "redis-ca"}}}
    spec = parse_spec(raw)
    for d, prefix in ((builders.worker_deployment(spec, name=NAME, namespace=NS), "ADASERVE_"),
                      (builders.gateway_deployment(spec, name=NAME, namespace=NS), "ADASERVE_GATEWAY_")):
        env = env_of(d)
        assert env[f"{prefix}REDIS_USERNAME"] == "adaserve"
        assert env[f"{prefix}REDIS_PASSWORD"] == {"secretKeyRef": {"name": "r", "key": "pw"}}
        assert env[f"{prefix}REDIS_TLS_CA_FILE"] == "/etc/adaserve/redis-tls/ca.crt"
        pod = d["spec"]["template"]["spec"]
        assert {"name": "redis-tls", "secret": {"secretName": "redis-ca"}} in pod["volumes"]
        assert {"name": "redis-tls", "mountPath": "/etc/adaserve/redis-tls", "readOnly": True} in pod["containers"][
            0]["volumeMounts"]
    assert [c["kind"] for c in builders.children(spec, name=NAME, namespace=NS)].count("Deployment") == 2


def test_the_worker_token_goes_to_workers_and_gateways_from_one_secret(raw: dict[str, Any]) -> None:
    spec = parse_spec(raw)
    assert "ADASERVE_AUTH_TOKEN" not in env_of(builders.worker_deployment(spec, name=NAME, namespace=NS))
    raw["workerAuth"] = {"tokenSecret": {"name": "llama-worker-token"}}
    spec = parse_spec(raw)
    ref = {"secretKeyRef": {"name": "llama-worker-token", "key": "token"}}
    assert env_of(builders.worker_deployment(spec, name=NAME, namespace=NS))["ADASERVE_AUTH_TOKEN"] == ref
    assert env_of(builders.gateway_deployment(spec, name=NAME, namespace=NS))["ADASERVE_GATEWAY_WORKER_TOKEN"] == ref
