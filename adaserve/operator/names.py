"""Names and labels every child shares (docs/k8s-contract.md fixes them)."""

from __future__ import annotations

GROUP = "adaserve.io"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "AdaServeDeployment"
PLURAL = "adaservedeployments"

MANAGED_BY = "adaserve-operator"
WORKER, GATEWAY, REDIS = "worker", "gateway", "redis"

WORKER_PORT = 8000
GATEWAY_CONTAINER_PORT = 8080
REDIS_PORT = 6379
SLO_CLASSES_KEY = "slo-classes.json"


def slo_configmap(name: str) -> str:
    return f"{name}-slo-classes"


def child(name: str, component: str) -> str:
    """``{name}-worker``, ``{name}-gateway``, ``{name}-redis``: each a Deployment and a Service."""
    return f"{name}-{component}"


def selector(name: str, component: str) -> dict[str, str]:
    """The labels a Deployment selects its pods by: never changes once created (selectors are immutable)."""
    return {
        "app.kubernetes.io/name": "adaserve",
        "app.kubernetes.io/instance": name,
        "app.kubernetes.io/component": component,
    }


def labels(name: str, component: str) -> dict[str, str]:
    return {
        **selector(name, component),
        "app.kubernetes.io/managed-by": MANAGED_BY,
        "adaserve.io/component": component,
    }


def common_labels(name: str) -> dict[str, str]:
    """For children that belong to no one component (the SLO ConfigMap)."""
    return {"app.kubernetes.io/name": "adaserve", "app.kubernetes.io/instance": name,
            "app.kubernetes.io/managed-by": MANAGED_BY}


def redis_prefix(namespace: str, name: str) -> str:
    """Key prefix shared by the workers, the gateway and the operator."""
    return f"adaserve:{namespace}:{name}"


def managed_redis_url(namespace: str, name: str) -> str:
    return f"redis://{child(name, REDIS)}.{namespace}.svc:{REDIS_PORT}/0"


def gateway_url(namespace: str, name: str, port: int) -> str:
    return f"http://{child(name, GATEWAY)}.{namespace}.svc:{port}"
