"""Pure builders: a validated spec in, the exact child manifests out (docs/k8s-contract.md).

No I/O and no kopf here: the handlers add the ownerReference and send these to the API server, and the
tests compare them whole. Every manifest is complete (not a patch), so applying one twice is a no-op.
"""

from __future__ import annotations

import hashlib
import json
import shlex
from typing import Any

from adaserve.operator import names
from adaserve.operator.spec import DeploymentSpec, PodOverride

Manifest = dict[str, Any]

MODELS_DIR = "/models"
CACHE_DIR = "/var/cache/adaserve"
SLO_DIR = "/etc/adaserve/slo"
API_KEYS_DIR = "/etc/adaserve/api-keys"
# Loading a large model and profiling it takes minutes: the startup probe allows 30 min before the
# kubelet gives up, and liveness only starts after it (probes of a loading worker would kill it).
STARTUP_PERIOD_S, STARTUP_FAILURES = 10, 180
TERMINATION_GRACE_S = 45  # > ADASERVE_DRAIN_GRACE_S (30): in-flight requests finish before SIGKILL
DRAIN_GRACE_S = 30
# A tensor-parallel worker's /dev/shm (emptyDir, medium Memory) unless resources.shmSize says: NCCL's buffers between
# ranks of one pod live there, and a container runtime's default (64Mi) is too small for them.
DEFAULT_SHM_SIZE = "1Gi"
SHM_DIR = "/dev/shm"
REDIS_TLS_DIR = "/etc/adaserve/redis-tls"
# The gateway's container unless spec.gateway.resources says: one asyncio process that relays tokens (65 MiB
# resident idle and after 600 small requests, measured on CPU; not measured under streaming load). A request so the
# scheduler counts it, a memory limit well above it so a leak ends in a restart rather than a node under pressure,
# and no CPU limit (throttling a relay adds latency to every token).
DEFAULT_GATEWAY_RESOURCES: dict[str, dict[str, str]] = {"requests": {"cpu": "250m", "memory": "256Mi"},
                                                        "limits": {"memory": "1Gi"}}


def children(spec: DeploymentSpec, *, name: str, namespace: str) -> list[Manifest]:
    """Every child of one resource, in the order they should be created (what others depend on first)."""
    out = [slo_configmap(spec, name=name, namespace=namespace)]
    if spec.redis.managed:
        out += [redis_deployment(spec, name=name, namespace=namespace), redis_service(name=name, namespace=namespace)]
    out += [
        worker_deployment(spec, name=name, namespace=namespace),
        worker_service(name=name, namespace=namespace),
        gateway_deployment(spec, name=name, namespace=namespace),
        gateway_service(spec, name=name, namespace=namespace),
    ]
    if spec.disruption_budget is not None:
        out.append(worker_disruption_budget(spec, name=name, namespace=namespace))
    return out


def redis_url(spec: DeploymentSpec, *, name: str, namespace: str) -> str:
    return names.managed_redis_url(namespace, name) if spec.redis.managed else str(spec.redis.url)


def slo_classes_json(spec: DeploymentSpec) -> str:
    """The ConfigMap's file: the classes as in the spec (camelCase), defaults filled in."""
    classes = [c.model_dump(by_alias=True, exclude_none=True) for c in spec.slo_classes]
    return json.dumps(classes, indent=2) + "\n"


def slo_configmap(spec: DeploymentSpec, *, name: str, namespace: str) -> Manifest:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _meta(names.slo_configmap(name), namespace, names.common_labels(name)),
        "data": {names.SLO_CLASSES_KEY: slo_classes_json(spec)},
    }


def worker_env(spec: DeploymentSpec, *, name: str, namespace: str) -> list[dict[str, Any]]:
    m, sp, r = spec.model, spec.speculation, spec.resources
    env: list[dict[str, Any]] = [
        _env("ADASERVE_TARGET", _model_path(spec, m.target)),
        *([_env("ADASERVE_DRAFT", _model_path(spec, m.draft))] if m.draft is not None else []),
        # several drafts: a JSON list, as the worker's settings read it (docs/worker.md)
        *([_env("ADASERVE_DRAFTS", json.dumps([_model_path(spec, d) for d in m.drafts]))] if m.drafts else []),
        _env("ADASERVE_MODEL_NAME", m.name or name),
        _env("ADASERVE_DTYPE", m.dtype),
        _env("ADASERVE_DEVICE", "cuda" if spec.resources.gpus_per_worker > 0 else "cpu"),
        _env("ADASERVE_POLICY", sp.policy),
        # unset = profile the budget on this pod's GPU (the point of "auto")
        *([_env("ADASERVE_BUDGET", str(sp.budget))] if sp.budget != "auto" else []),
        _env("ADASERVE_MAX_DEPTH", str(sp.max_depth)),
        _env("ADASERVE_MAX_WIDTH", str(sp.max_width)),
        *([_env("ADASERVE_KV_MEMORY_FRACTION", repr(r.kv_memory_fraction))]
          if r.kv_memory_fraction is not None else []),
        *([_env("ADASERVE_KV_MEMORY_MB", str(r.kv_memory_mb))] if r.kv_memory_mb is not None else []),
        _env("ADASERVE_HOST", "0.0.0.0"),
        _env("ADASERVE_PORT", str(names.WORKER_PORT)),
        {"name": "ADASERVE_WORKER_ID", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        # POD_IP must come before the variable that expands it: $(VAR) only sees earlier entries
        {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        _env("ADASERVE_ADVERTISE_URL", f"http://$(POD_IP):{names.WORKER_PORT}"),
        _env("ADASERVE_REDIS_URL", redis_url(spec, name=name, namespace=namespace)),
        _env("ADASERVE_REDIS_PREFIX", names.redis_prefix(namespace, name)),
        *_redis_auth_env(spec, "ADASERVE_"),
        *_worker_token_env(spec, "ADASERVE_AUTH_TOKEN"),
        _env("ADASERVE_SLO_CLASSES", json.dumps({c.name: c.tpot_ms for c in spec.slo_classes})),
        _env("ADASERVE_DEFAULT_SLO_CLASS", spec.default_class),
        _env("ADASERVE_CACHE_DIR", CACHE_DIR),
        _env("ADASERVE_DRAIN_GRACE_S", str(DRAIN_GRACE_S)),
        *_pod_env(spec.worker_pod),
    ]
    return env


def _redis_auth_env(spec: DeploymentSpec, prefix: str) -> list[dict[str, Any]]:
    """The Redis password (from its Secret, resolved by the kubelet), the ACL user and the TLS CA file."""
    rd = spec.redis
    env: list[dict[str, Any]] = []
    if rd.password_secret is not None:
        ref = {"name": rd.password_secret.name, "key": rd.password_secret.key}
        env.append({"name": f"{prefix}REDIS_PASSWORD", "valueFrom": {"secretKeyRef": ref}})
    if rd.username is not None:
        env.append(_env(f"{prefix}REDIS_USERNAME", rd.username))
    if rd.tls is not None and rd.tls.ca_secret is not None:
        env.append(_env(f"{prefix}REDIS_TLS_CA_FILE", f"{REDIS_TLS_DIR}/{rd.tls.ca_secret.key}"))
    return env


def _redis_tls_volume(spec: DeploymentSpec) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(mounts, volumes) of the Redis CA certificate, when there is one."""
    tls = spec.redis.tls
    if tls is None or tls.ca_secret is None:
        return [], []
    return ([{"name": "redis-tls", "mountPath": REDIS_TLS_DIR, "readOnly": True}],
            [{"name": "redis-tls", "secret": {"secretName": tls.ca_secret.name}}])


def _worker_token_env(spec: DeploymentSpec, variable: str) -> list[dict[str, Any]]:
    """The token workers require on their generation routes and the gateway sends (spec.workerAuth)."""
    if spec.worker_auth is None:
        return []
    ref = {"name": spec.worker_auth.token_secret.name, "key": spec.worker_auth.token_secret.key}
    return [{"name": variable, "valueFrom": {"secretKeyRef": ref}}]


def _pod_env(pod: PodOverride) -> list[dict[str, Any]]:
    """The override's extra env, after the operator's own (the spec refuses names the operator sets)."""
    return [e.model_dump(by_alias=True, exclude_none=True) for e in pod.env]


def _pod_fields(pod: PodOverride) -> dict[str, Any]:
    """The pod-spec fields an override sets. Every key always present (empty or None when unset): the children are
    merge-patched, so a field removed from the spec must be written as empty to leave the live pods too."""
    return {
        "nodeSelector": dict(pod.node_selector) or None,
        "tolerations": [t.model_dump(by_alias=True, exclude_none=True) for t in pod.tolerations],
        "affinity": pod.affinity,
        "topologySpreadConstraints": list(pod.topology_spread_constraints),
        "imagePullSecrets": [{"name": s.name} for s in pod.image_pull_secrets],
        "priorityClassName": pod.priority_class_name,
        "runtimeClassName": pod.runtime_class_name,
        "serviceAccountName": pod.service_account_name,
    }


def _pod_volumes(pod: PodOverride) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(mounts, volumes) of the override, after the operator's own."""
    return ([m.model_dump(by_alias=True, exclude_none=True) for m in pod.volume_mounts],
            [v.model_dump() for v in pod.volumes])


def worker_deployment(spec: DeploymentSpec, *, name: str, namespace: str) -> Manifest:
    m, r = spec.model, spec.resources
    # Quantities as strings: the API server returns them so, and an int here would look like drift forever.
    requests: dict[str, str] = {}
    limits: dict[str, str] = {}
    if r.cpu is not None:
        requests["cpu"] = str(r.cpu)  # no CPU limit: throttling a tokenizer or a sampler only adds latency
    if r.memory is not None:
        requests["memory"] = limits["memory"] = str(r.memory)
    if r.gpus_per_worker > 0:  # an extended resource: requests must equal limits
        requests["nvidia.com/gpu"] = limits["nvidia.com/gpu"] = str(r.gpus_per_worker)
    requests.update((k, str(v)) for k, v in r.requests.items())
    limits.update((k, str(v)) for k, v in r.limits.items())
    mounts: list[dict[str, Any]] = [{"name": "cache", "mountPath": CACHE_DIR}]
    volumes: list[dict[str, Any]] = [{"name": "cache", "emptyDir": {}}]
    init: list[dict[str, Any]] = []
    command = ["adaserve", "worker"]
    if r.ranks > 1:  # one rank per GPU (the spec's rule), talking over shared memory
        command += ["--tensor-parallel-size", str(r.ranks)]
    if r.ranks > 1 or r.shm_size is not None:  # or asked for: a runtime's default /dev/shm is 64Mi
        mounts.append({"name": "shm", "mountPath": SHM_DIR})
        shm = str(r.shm_size or DEFAULT_SHM_SIZE)
        volumes.append({"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": shm}})
    if m.source == "pvc" and m.pvc is not None:
        mounts.append({"name": "models", "mountPath": MODELS_DIR, "readOnly": m.pvc.read_only})
        volumes.append({"name": "models",
                        "persistentVolumeClaim": {"claimName": m.pvc.claim_name, "readOnly": m.pvc.read_only}})
    elif m.source == "hub":
        mounts.append({"name": "models", "mountPath": MODELS_DIR, "readOnly": True})
        volumes.append({"name": "models", "emptyDir": {}})
        init.append(_fetch_container(spec))
    for extra_mounts, extra_volumes in (_redis_tls_volume(spec), _pod_volumes(spec.worker_pod)):
        mounts += extra_mounts
        volumes += extra_volumes
    http = {"port": "http"}
    container: dict[str, Any] = {
        "name": "worker",
        "image": spec.image,
        "command": command,
        "ports": [{"name": "http", "containerPort": names.WORKER_PORT, "protocol": "TCP"}],
        "env": worker_env(spec, name=name, namespace=namespace),
        "resources": {"requests": requests, "limits": limits},
        "volumeMounts": mounts,
        "startupProbe": {"httpGet": {"path": "/readyz", **http},
                         "periodSeconds": STARTUP_PERIOD_S, "failureThreshold": STARTUP_FAILURES},
        "livenessProbe": {"httpGet": {"path": "/healthz", **http}, "periodSeconds": 10, "failureThreshold": 3},
        "readinessProbe": {"httpGet": {"path": "/readyz", **http}, "periodSeconds": 5, "failureThreshold": 2},
    }
    pod: dict[str, Any] = {
        "terminationGracePeriodSeconds": TERMINATION_GRACE_S,
        # always present, even empty: a merge patch then removes a fetcher when the source stops being hub
        "initContainers": init,
        "containers": [container],
        "volumes": volumes,
        **_pod_fields(spec.worker_pod),
    }
    return _deployment(name, namespace, names.WORKER, replicas=spec.replicas, pod=pod, override=spec.worker_pod)


def worker_disruption_budget(spec: DeploymentSpec, *, name: str, namespace: str) -> Manifest:
    """How many worker pods a voluntary disruption (a node drain, a cluster upgrade) may take at once."""
    b = spec.disruption_budget
    assert b is not None
    limit = {"maxUnavailable": b.max_unavailable} if b.max_unavailable is not None else {
        "minAvailable": b.min_available}
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": _meta(names.child(name, names.WORKER), namespace, names.labels(name, names.WORKER)),
        "spec": {"selector": {"matchLabels": names.selector(name, names.WORKER)}, **limit},
    }


def _fetch_container(spec: DeploymentSpec) -> dict[str, Any]:
    ids = [spec.model.target, *spec.model.draft_list]
    script = " && ".join(
        f"hf download {shlex.quote(i)} --local-dir {shlex.quote(f'{MODELS_DIR}/{i}')}" for i in ids)
    return {
        "name": "adaserve-fetch",
        "image": spec.image,
        "command": ["sh", "-c", script],
        "env": _hub_token_env(spec),
        "volumeMounts": [{"name": "models", "mountPath": MODELS_DIR}],
    }


def _hub_token_env(spec: DeploymentSpec) -> list[dict[str, Any]]:
    """HF_TOKEN from the Secret, for gated models: only here, as the worker loads local files only.

    Always a list, even empty: drift detection only compares keys the manifest has, so a token removed
    from the spec must leave ``env: []`` behind to be removed from the live pod template.
    """
    hub = spec.model.hub
    if hub is None or hub.token_secret is None:
        return []
    ref = {"name": hub.token_secret.name, "key": hub.token_secret.key}
    return [{"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": ref}}]


def _model_path(spec: DeploymentSpec, value: str) -> str:
    """Hub ids are fetched to /models/<id>; paths (image, PVC) and builtin names are used as given."""
    return f"{MODELS_DIR}/{value}" if spec.model.source == "hub" else value


def worker_service(*, name: str, namespace: str) -> Manifest:
    return _service(name, namespace, names.WORKER, port=names.WORKER_PORT, service_type="ClusterIP")


def gateway_deployment(spec: DeploymentSpec, *, name: str, namespace: str) -> Manifest:
    g = spec.gateway
    env = [
        _env("ADASERVE_GATEWAY_HOST", "0.0.0.0"),
        _env("ADASERVE_GATEWAY_PORT", str(names.GATEWAY_CONTAINER_PORT)),
        _env("ADASERVE_GATEWAY_REDIS_URL", redis_url(spec, name=name, namespace=namespace)),
        _env("ADASERVE_GATEWAY_REDIS_PREFIX", names.redis_prefix(namespace, name)),
        _env("ADASERVE_GATEWAY_MODEL_NAME", spec.model.name or name),
        _env("ADASERVE_GATEWAY_SLO_CLASSES_FILE", f"{SLO_DIR}/{names.SLO_CLASSES_KEY}"),
        _env("ADASERVE_GATEWAY_DEFAULT_SLO_CLASS", spec.default_class),
        _env("ADASERVE_GATEWAY_ROUTING", g.routing),
        *_redis_auth_env(spec, "ADASERVE_GATEWAY_"),
        *_worker_token_env(spec, "ADASERVE_GATEWAY_WORKER_TOKEN"),
    ]
    mounts: list[dict[str, Any]] = [{"name": "slo-classes", "mountPath": SLO_DIR, "readOnly": True}]
    volumes: list[dict[str, Any]] = [{"name": "slo-classes", "configMap": {"name": names.slo_configmap(name)}}]
    if g.api_keys_secret is not None:
        env.append(_env("ADASERVE_GATEWAY_API_KEYS_FILE", f"{API_KEYS_DIR}/{g.api_keys_secret.key}"))
        mounts.append({"name": "api-keys", "mountPath": API_KEYS_DIR, "readOnly": True})
        volumes.append({"name": "api-keys", "secret": {"secretName": g.api_keys_secret.name}})
    env += _pod_env(g.pod)
    for extra_mounts, extra_volumes in (_redis_tls_volume(spec), _pod_volumes(g.pod)):
        mounts += extra_mounts
        volumes += extra_volumes
    resources = g.resources.model_dump() if g.resources is not None else DEFAULT_GATEWAY_RESOURCES
    http = {"port": "http"}
    pod = {
        "containers": [{
            "name": "gateway",
            "image": g.image,
            "command": ["python", "-m", "adaserve.gateway"],
            "ports": [{"name": "http", "containerPort": names.GATEWAY_CONTAINER_PORT, "protocol": "TCP"}],
            "env": env,
            "resources": {k: {q: str(v) for q, v in m.items()} for k, m in resources.items()},
            "volumeMounts": mounts,
            "livenessProbe": {"httpGet": {"path": "/healthz", **http}, "periodSeconds": 10, "failureThreshold": 3},
            "readinessProbe": {"httpGet": {"path": "/readyz", **http}, "periodSeconds": 5, "failureThreshold": 2},
        }],
        "volumes": volumes,
        **_pod_fields(g.pod),
    }
    # The gateway reads the classes file at start: a changed class list rolls its pods through this hash.
    digest = hashlib.sha256(slo_classes_json(spec).encode()).hexdigest()[:16]
    return _deployment(name, namespace, names.GATEWAY, replicas=g.replicas, pod=pod,
                       pod_annotations={"adaserve.io/slo-classes-sha256": digest}, override=g.pod)


def gateway_service(spec: DeploymentSpec, *, name: str, namespace: str) -> Manifest:
    return _service(name, namespace, names.GATEWAY, port=spec.gateway.port, service_type=spec.gateway.service_type)


def redis_deployment(spec: DeploymentSpec, *, name: str, namespace: str) -> Manifest:
    # registrations are soft state that workers rewrite every heartbeat: nothing to persist
    args = ["--save", "", "--appendonly", "no"]
    env: list[dict[str, Any]] = []
    secret = spec.redis.password_secret
    if secret is not None:  # AUTH required; redis-cli (the readiness probe) reads REDISCLI_AUTH
        ref = {"secretKeyRef": {"name": secret.name, "key": secret.key}}
        env = [{"name": "REDIS_PASSWORD", "valueFrom": ref}, {"name": "REDISCLI_AUTH", "valueFrom": ref}]
        args += ["--requirepass", "$(REDIS_PASSWORD)"]
    pod = {
        "containers": [{
            "name": "redis",
            "image": spec.redis.image,
            "args": args,
            "env": env,
            "ports": [{"name": "redis", "containerPort": names.REDIS_PORT, "protocol": "TCP"}],
            "livenessProbe": {"tcpSocket": {"port": "redis"}, "periodSeconds": 10},
            "readinessProbe": {"exec": {"command": ["redis-cli", "ping"]}, "periodSeconds": 5},
        }],
    }
    return _deployment(name, namespace, names.REDIS, replicas=1, pod=pod, strategy={"type": "Recreate"})


def redis_service(*, name: str, namespace: str) -> Manifest:
    return _service(name, namespace, names.REDIS, port=names.REDIS_PORT, service_type="ClusterIP", port_name="redis")


def _env(key: str, value: str) -> dict[str, Any]:
    return {"name": key, "value": value}


def _meta(name: str, namespace: str, labels: dict[str, str]) -> dict[str, Any]:
    return {"name": name, "namespace": namespace, "labels": labels}


def _deployment(name: str, namespace: str, component: str, *, replicas: int, pod: dict[str, Any],
                pod_annotations: dict[str, str] | None = None, strategy: dict[str, Any] | None = None,
                override: PodOverride | None = None) -> Manifest:
    # the override's labels and annotations beside the operator's (the spec refuses the operator's label keys)
    template_meta: dict[str, Any] = {"labels": {**(override.labels if override else {}),
                                                **names.labels(name, component)}}
    annotations = {**(override.annotations if override else {}), **(pod_annotations or {})}
    if annotations:
        template_meta["annotations"] = annotations
    spec: dict[str, Any] = {
        "replicas": replicas,
        "selector": {"matchLabels": names.selector(name, component)},
        "template": {"metadata": template_meta, "spec": pod},
    }
    if strategy is not None:
        spec["strategy"] = strategy
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _meta(names.child(name, component), namespace, names.labels(name, component)),
        "spec": spec,
    }


def _service(name: str, namespace: str, component: str, *, port: int, service_type: str,
             port_name: str = "http") -> Manifest:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(names.child(name, component), namespace, names.labels(name, component)),
        "spec": {
            "type": service_type,
            "selector": names.selector(name, component),
            "ports": [{"name": port_name, "port": port, "targetPort": port_name, "protocol": "TCP"}],
        },
    }
