"""The AdaServeDeployment spec, parsed and validated again on the operator's side.

The CRD's OpenAPI schema and CEL rules reject bad resources at the API server, but CEL needs Kubernetes
1.25+ and an older or emulated API server accepts whatever CEL would refuse: the operator must
never render children from a spec it has not checked itself. The rules here mirror the CRD's, with the
same messages, and every error names the field it is about (``spec.sloClasses[1].tpotMs: ...``).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PlainValidator, ValidationError, field_validator
from pydantic.alias_generators import to_camel

from adaserve.contract.slo import CLASS_NAME

# adaserve/engine/speculation/policies.py make_policy: a name, chain:K or beam[:D,W], or one of Spin's names;
# with several drafts a @SELECTOR suffix names how each request's draft is chosen (ucb, eps, length, or dN to pin one).
POLICY = (r"^(adaserve|incremental|specinfer|smartspec|equal-greedy|global-greedy"
          r"|chain:[1-9][0-9]*|beam(:[1-9][0-9]*,[1-9][0-9]*)?|spin|spin-eps|spin-length)"
          r"(@(ucb|eps|length|d[0-9]))?$")
# The models the worker image carries by name (adaserve/engine/loading/catalog.py NAMES; a test keeps them equal).
BUILTIN_MODELS = ("smollm2-135m-instruct", "demo-tiny")
# The drafts it carries for the default model (catalog.py DRAFT_NAMES): model.drafts may name them.
BUILTIN_DRAFTS = ("smollm2-draft", "smollm2-draft-small")
MAX_DRAFTS = 8
# A Hugging Face hub id: name or owner/name.
HUB_ID = r"^[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?$"
# Kubernetes resource.Quantity, as in the API's own OpenAPI schema.
QUANTITY = (r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))"
            r"(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$")
REDIS_URL = r"^(redis|rediss|unix)://.+$"

# The CEL rules' messages (crds/adaserve.io_adaservedeployments.yaml): one wording for both checks.
MSG_UNIQUE_CLASSES = "sloClasses names must be unique"
MSG_DEFAULT_CLASS = "defaultSloClass must name one of sloClasses"
MSG_TPOT = "tpotMs must be > 0"
MSG_TTFT = "ttftMs must be > 0"
MSG_REDIS_ONE = "set exactly one of redis.managed: true or redis.url"
MSG_PVC = "model.pvc is required with source: pvc and not allowed otherwise"
MSG_HUB = "model.hub is only allowed with source: hub"
MSG_TARGET_PATH = "with source image or pvc, target and draft must be absolute paths"
MSG_BUILTIN = ("with source builtin, target must name a model the worker image carries "
               "(smollm2-135m-instruct or demo-tiny) and draft must not be set: the named model brings its own")
MSG_TARGET_HUB = "with source hub, target and draft must be hub ids (owner/name)"
MSG_BUDGET = 'budget must be "auto" or an integer >= 1'
MSG_DRAFT = "speculation.policy other than incremental needs model.draft or model.drafts"
MSG_DRAFT_OR_DRAFTS = "set model.draft or model.drafts, not both: drafts lists every draft, the first one included"
MSG_BUILTIN_DRAFTS = ("with source builtin, drafts may only name the drafts the worker image carries for "
                      "smollm2-135m-instruct (smollm2-draft, smollm2-draft-small)")
MSG_UNIQUE_DRAFTS = "model.drafts must not name a draft twice"
MSG_PINNED_DRAFT = "a policy ending in @dN pins draft N: N must be below the number of model.drafts"
MSG_TENSOR_PARALLEL = "tensorParallelSize must equal gpusPerWorker when the worker has GPUs (one rank per GPU)"
MSG_KV_MEMORY = "set resources.kvMemory or resources.kvMemoryFraction, not both"
MSG_OWN_RESOURCES = ("requests and limits name other resources (ephemeral-storage, rdma/...): cpu, memory and "
                     "nvidia.com/gpu come from resources.cpu, memory and gpusPerWorker")
MSG_DISRUPTION_BUDGET = "set exactly one of disruptionBudget.maxUnavailable or disruptionBudget.minAvailable"
MSG_RESERVED_ENV = "env must not set a variable the operator sets (docs/kubernetes.md lists them): use the spec field"
MSG_UNIQUE_ENV = "env names must be unique"
MSG_ENV_VALUE = "an env entry sets value or valueFrom, not both"
MSG_RESERVED_VOLUME = "volume names cache, shm, models, slo-classes, api-keys and redis-tls are the operator's"
MSG_UNIQUE_VOLUMES = "volume names must be unique"
MSG_MOUNT_VOLUME = "every volumeMount must name one of the pod's volumes"
MSG_RESERVED_MOUNT = ("volumeMounts must not use a path the operator mounts (/models, /dev/shm, /var/cache/adaserve, "
                      "/etc/adaserve)")
MSG_RESERVED_LABELS = "labels must not set app.kubernetes.io/ or adaserve.io/ keys: the operator's selectors use them"
MSG_TOLERATION_EXISTS = "a toleration with operator Exists must not set value"
MSG_TOLERATION_SECONDS = "tolerationSeconds is only allowed with effect NoExecute"
MSG_REDIS_USERNAME = "redis.username names an ACL user of an external Redis: only with redis.url and passwordSecret"
MSG_REDIS_TLS = "redis.tls needs an external redis.url starting with rediss:// (the scheme turns TLS on)"

# Every variable the operator may set in a worker or gateway container, whatever the spec says: pod env must not
# name one (it would silently override, or be overridden by, the operator's). builders.py renders from this set.
RESERVED_ENV = (
    "ADASERVE_TARGET", "ADASERVE_DRAFT", "ADASERVE_DRAFTS", "ADASERVE_MODEL_NAME", "ADASERVE_DTYPE", "ADASERVE_DEVICE",
    "ADASERVE_POLICY", "ADASERVE_BUDGET", "ADASERVE_MAX_DEPTH", "ADASERVE_MAX_WIDTH", "ADASERVE_KV_MEMORY_FRACTION",
    "ADASERVE_KV_MEMORY_MB", "ADASERVE_HOST", "ADASERVE_PORT", "ADASERVE_WORKER_ID", "POD_IP",
    "ADASERVE_ADVERTISE_URL", "ADASERVE_REDIS_URL", "ADASERVE_REDIS_PREFIX", "ADASERVE_REDIS_PASSWORD",
    "ADASERVE_REDIS_USERNAME", "ADASERVE_REDIS_TLS_CA_FILE", "ADASERVE_AUTH_TOKEN", "ADASERVE_SLO_CLASSES",
    "ADASERVE_DEFAULT_SLO_CLASS", "ADASERVE_CACHE_DIR", "ADASERVE_DRAIN_GRACE_S", "HF_TOKEN",
    "ADASERVE_GATEWAY_HOST", "ADASERVE_GATEWAY_PORT", "ADASERVE_GATEWAY_REDIS_URL", "ADASERVE_GATEWAY_REDIS_PREFIX",
    "ADASERVE_GATEWAY_REDIS_PASSWORD", "ADASERVE_GATEWAY_REDIS_USERNAME", "ADASERVE_GATEWAY_REDIS_TLS_CA_FILE",
    "ADASERVE_GATEWAY_WORKER_TOKEN", "ADASERVE_GATEWAY_MODEL_NAME", "ADASERVE_GATEWAY_SLO_CLASSES_FILE",
    "ADASERVE_GATEWAY_DEFAULT_SLO_CLASS", "ADASERVE_GATEWAY_ROUTING", "ADASERVE_GATEWAY_API_KEYS_FILE",
)
RESERVED_VOLUMES = ("cache", "shm", "models", "slo-classes", "api-keys", "redis-tls")
RESERVED_MOUNTS = ("/models", "/dev/shm", "/var/cache/adaserve")
RESERVED_MOUNT_PREFIX = "/etc/adaserve"
RESERVED_LABEL_PREFIXES = ("app.kubernetes.io/", "adaserve.io/")
# resources the typed fields set (resources.cpu, memory, gpusPerWorker): requests/limits may name only others
OWN_RESOURCES = ("cpu", "memory", "nvidia.com/gpu")
# a size in whole MiB, GiB or TiB (resources.kvMemory): the worker's --kv-memory-mb
KV_MEMORY = r"^[1-9][0-9]*(Mi|Gi|Ti)$"
# an env var name (the API server's C_IDENTIFIER-like rule for env: letters, digits, '_', '-', '.')
ENV_NAME = r"^[-._a-zA-Z][-._a-zA-Z0-9]*$"
# a DNS-1123 label: volume names, Secret names are subdomains but every name here fits a label
DNS_LABEL = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
# maxUnavailable / minAvailable: a number of pods or a percentage
INT_OR_PERCENT = r"^[0-9]+%?$"


class SpecError(ValueError):
    """An invalid spec: ``path`` is the field (``spec.redis``), ``message`` what is wrong with it."""

    def __init__(self, path: str, message: str) -> None:
        super().__init__(f"{path}: {message}")
        self.path = path
        self.message = message


class _Model(BaseModel):
    # strict: "2" is not 2 and "true" is not true, as in the API server; forbid: a typo is an error, not a no-op
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid", frozen=True,
                              strict=True)




def _quantity(value: object) -> int | str:
    if isinstance(value, bool) or not isinstance(value, int | str) or (
            isinstance(value, str) and not re.match(QUANTITY, value)):
        raise ValueError("must be a Kubernetes quantity such as 64Gi, 500m or 8")
    return value


Quantity = Annotated[int | str, PlainValidator(_quantity)]


class Pvc(_Model):
    claim_name: str = Field(min_length=1)
    read_only: bool = True


class SecretKey(_Model):
    """A key of a Secret in the resource's namespace (rendered as a secretKeyRef, never read here)."""

    name: str = Field(min_length=1)
    key: str = Field("token", min_length=1)


class Hub(_Model):
    # gated or private models: the token the download authenticates with (env HF_TOKEN)
    token_secret: SecretKey | None = None


class ModelSource(_Model):
    name: str | None = None
    source: Literal["image", "pvc", "hub", "builtin"] = "image"
    pvc: Pvc | None = None
    hub: Hub | None = None
    target: str = Field(min_length=1)
    draft: str | None = None
    drafts: list[str] | None = Field(None, min_length=1, max_length=MAX_DRAFTS)
    dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"

    @property
    def draft_list(self) -> list[str]:
        """Every draft: ``drafts``, else ``draft``, else none."""
        return list(self.drafts or ([self.draft] if self.draft is not None else []))


class Resources(_Model):
    gpus_per_worker: int = Field(1, ge=0)
    # the worker's --kv-memory-fraction (its KV caches sized from the device's memory); unset: its fixed default
    kv_memory_fraction: float | None = Field(None, gt=0, le=1)
    kv_memory: str | None = Field(None, pattern=KV_MEMORY)  # or a size: the worker's --kv-memory-mb (per model)
    tensor_parallel_size: int | None = Field(None, ge=1, le=16)  # unset: 1
    shm_size: Quantity | None = None  # the /dev/shm of a tensor-parallel worker (builders.DEFAULT_SHM_SIZE)
    memory: Quantity | None = None
    cpu: Quantity | None = None
    # other resources (ephemeral-storage, rdma/hca, ...), added to what the fields above set
    requests: dict[str, Quantity] = Field({}, max_length=16)
    limits: dict[str, Quantity] = Field({}, max_length=16)

    @property
    def ranks(self) -> int:
        """The worker's tensor-parallel size: ``tensorParallelSize``, else 1."""
        return self.tensor_parallel_size or 1

    @property
    def kv_memory_mb(self) -> int | None:
        """``kvMemory`` in MiB (the pattern allows only whole Mi, Gi and Ti)."""
        if self.kv_memory is None:
            return None
        return int(self.kv_memory[:-2]) * {"Mi": 1, "Gi": 1024, "Ti": 1024 * 1024}[self.kv_memory[-2:]]


class ResourceRequirements(_Model):
    """A container's requests and limits, as Kubernetes writes them (the gateway's)."""

    requests: dict[str, Quantity] = {}
    limits: dict[str, Quantity] = {}


class LocalObjectReference(_Model):
    name: str = Field(min_length=1)


class Toleration(_Model):
    key: str | None = None
    operator: Literal["Exists", "Equal"] = "Equal"
    value: str | None = None
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None
    toleration_seconds: int | None = None


class EnvVar(_Model):
    name: str = Field(pattern=ENV_NAME)
    value: str | None = None
    value_from: dict[str, Any] | None = None  # secretKeyRef, configMapKeyRef, fieldRef...: the API server checks it


class Volume(BaseModel):
    """A pod volume: its name is checked here, its source (any of Kubernetes' kinds) by the API server."""

    model_config = ConfigDict(extra="allow", frozen=True, strict=True)
    name: str = Field(pattern=DNS_LABEL, max_length=63)


class VolumeMount(_Model):
    name: str = Field(min_length=1)
    mount_path: str = Field(pattern=r"^/", max_length=1024)
    read_only: bool = False
    sub_path: str | None = None


class PodOverride(_Model):
    """What a platform sets on the worker (or gateway) pods beyond what the operator renders itself: scheduling,
    pull secrets, extra env and volumes. Rendered as given; objects the operator does not model (affinity, a
    volume's source, topology spread) are checked by the API server when the Deployment is written."""

    annotations: dict[str, str] = {}
    labels: dict[str, str] = Field({}, max_length=64)
    node_selector: dict[str, str] = {}
    tolerations: list[Toleration] = Field([], max_length=32)
    affinity: dict[str, Any] | None = None
    topology_spread_constraints: list[dict[str, Any]] = []
    image_pull_secrets: list[LocalObjectReference] = []
    priority_class_name: str | None = Field(None, min_length=1)
    runtime_class_name: str | None = Field(None, min_length=1)
    service_account_name: str | None = Field(None, min_length=1)
    env: list[EnvVar] = Field([], max_length=64)
    volumes: list[Volume] = Field([], max_length=32)
    volume_mounts: list[VolumeMount] = Field([], max_length=32)


class DisruptionBudget(_Model):
    """The worker pods' PodDisruptionBudget: how many a voluntary disruption (a node drain) may take at once."""

    max_unavailable: int | str | None = None
    min_available: int | str | None = None

    @field_validator("max_unavailable", "min_available")
    @classmethod
    def _count_or_percent(cls, v: int | str | None) -> int | str | None:
        if (isinstance(v, int) and v < 0) or (isinstance(v, str) and not re.match(INT_OR_PERCENT, v)):
            raise ValueError("must be a number of pods >= 0 or a percentage such as 25%")
        return v


class SloClass(_Model):
    name: str = Field(pattern=CLASS_NAME.pattern)  # what workers and gateways accept; the CRD has it too
    tpot_ms: int
    ttft_ms: int | None = None
    priority: int = 0
    sheddable: bool = False


class Speculation(_Model):
    policy: str = Field("adaserve", pattern=POLICY)
    budget: int | str = "auto"
    max_depth: int = Field(4, ge=1, le=32)
    max_width: int = Field(2, ge=1, le=16)


class ApiKeysSecret(_Model):
    name: str = Field(min_length=1)
    key: str = Field("api-keys.json", min_length=1)


class Gateway(_Model):
    replicas: int = Field(1, ge=0)
    image: str = Field(min_length=1)
    service_type: Literal["ClusterIP", "NodePort", "LoadBalancer"] = "ClusterIP"
    port: int = Field(80, ge=1, le=65535)
    routing: Literal["headroom", "least-loaded", "round-robin"] = "headroom"
    api_keys_secret: ApiKeysSecret | None = None
    resources: ResourceRequirements | None = None  # unset: builders.DEFAULT_GATEWAY_RESOURCES
    pod: PodOverride = PodOverride()


class PasswordSecret(_Model):
    name: str = Field(min_length=1)
    key: str = Field("password", min_length=1)


class CaSecret(_Model):
    name: str = Field(min_length=1)
    key: str = Field("ca.crt", min_length=1)


class RedisTls(_Model):
    # a private CA's certificate (PEM) the services verify the server with; unset: the system's CAs
    ca_secret: CaSecret | None = None


class Redis(_Model):
    managed: bool = False
    image: str = "redis:7-alpine"
    url: str | None = Field(None, pattern=REDIS_URL)
    # AUTH: the password (managed: the one the Redis pod is started with) and, for ACL users, the user name
    password_secret: PasswordSecret | None = None
    username: str | None = Field(None, min_length=1)
    tls: RedisTls | None = None


class WorkerAuth(_Model):
    # a Secret holding the token workers require on generation routes; the gateway sends it
    token_secret: SecretKey


class DeploymentSpec(_Model):
    model: ModelSource
    replicas: int = Field(1, ge=0)
    image: str = Field(min_length=1)
    resources: Resources = Resources()
    slo_classes: list[SloClass] = Field(min_length=1, max_length=16)
    default_slo_class: str | None = None
    speculation: Speculation = Speculation()
    gateway: Gateway
    redis: Redis
    worker_pod: PodOverride = PodOverride()
    disruption_budget: DisruptionBudget | None = None
    worker_auth: WorkerAuth | None = None

    @property
    def default_class(self) -> str:
        """The class of requests that name none: ``defaultSloClass``, else the first class."""
        return self.default_slo_class or self.slo_classes[0].name


def parse_spec(spec: Mapping[str, Any] | None) -> DeploymentSpec:
    """The typed spec, or SpecError naming the first bad field."""
    try:
        parsed = DeploymentSpec.model_validate(dict(spec or {}))
    except ValidationError as e:
        first = e.errors()[0]
        raise SpecError(_path(first["loc"]), _message(first)) from None
    _check_rules(parsed)
    return parsed


def _check_rules(s: DeploymentSpec) -> None:
    """The CRD's CEL rules, in the same order and words."""
    m = s.model
    if (m.source == "pvc") != (m.pvc is not None):
        raise SpecError("spec.model", MSG_PVC)
    if m.source != "hub" and m.hub is not None:
        raise SpecError("spec.model", MSG_HUB)
    if m.source == "builtin" and (m.target not in BUILTIN_MODELS or m.draft is not None):
        raise SpecError("spec.model", MSG_BUILTIN)
    if m.draft is not None and m.drafts is not None:
        raise SpecError("spec.model", MSG_DRAFT_OR_DRAFTS)
    drafts = m.drafts or []
    if len(set(drafts)) != len(drafts):
        raise SpecError("spec.model.drafts", MSG_UNIQUE_DRAFTS)
    if m.source == "builtin" and drafts and (m.target != BUILTIN_MODELS[0] or
                                             any(d not in BUILTIN_DRAFTS for d in drafts)):
        raise SpecError("spec.model.drafts", MSG_BUILTIN_DRAFTS)
    fields = [("target", m.target), ("draft", m.draft), *((f"drafts[{i}]", d) for i, d in enumerate(drafts))]
    for field, value in fields:
        if value is None or m.source == "builtin":
            continue
        if m.source == "hub" and not re.match(HUB_ID, value):
            raise SpecError(f"spec.model.{field}", MSG_TARGET_HUB)
        if m.source != "hub" and not value.startswith("/"):
            raise SpecError(f"spec.model.{field}", MSG_TARGET_PATH)
    r = s.resources
    if r.tensor_parallel_size is not None and r.gpus_per_worker > 0 and r.tensor_parallel_size != r.gpus_per_worker:
        raise SpecError("spec.resources.tensorParallelSize", MSG_TENSOR_PARALLEL)
    for i, c in enumerate(s.slo_classes):
        if c.tpot_ms <= 0:
            raise SpecError(f"spec.sloClasses[{i}].tpotMs", MSG_TPOT)
        if c.ttft_ms is not None and c.ttft_ms <= 0:
            raise SpecError(f"spec.sloClasses[{i}].ttftMs", MSG_TTFT)
    names = [c.name for c in s.slo_classes]
    if len(set(names)) != len(names):
        raise SpecError("spec.sloClasses", MSG_UNIQUE_CLASSES)
    if s.default_slo_class is not None and s.default_slo_class not in names:
        raise SpecError("spec.defaultSloClass", MSG_DEFAULT_CLASS)
    budget = s.speculation.budget
    if budget != "auto" and (isinstance(budget, str) or budget < 1):
        raise SpecError("spec.speculation.budget", MSG_BUDGET)
    if s.speculation.policy != "incremental" and not m.draft_list and m.source != "builtin":
        raise SpecError("spec.speculation.policy", MSG_DRAFT)
    pinned = re.search(r"@d([0-9])$", s.speculation.policy)
    if pinned and drafts and int(pinned.group(1)) >= len(drafts):
        raise SpecError("spec.speculation.policy", MSG_PINNED_DRAFT)
    if (s.redis.url is not None) == s.redis.managed:
        raise SpecError("spec.redis", MSG_REDIS_ONE)
    if s.redis.username is not None and (s.redis.url is None or s.redis.password_secret is None):
        raise SpecError("spec.redis", MSG_REDIS_USERNAME)
    if s.redis.tls is not None and not (s.redis.url or "").startswith("rediss://"):
        raise SpecError("spec.redis", MSG_REDIS_TLS)
    if r.kv_memory is not None and r.kv_memory_fraction is not None:
        raise SpecError("spec.resources", MSG_KV_MEMORY)
    if any(k in OWN_RESOURCES for k in (*r.requests, *r.limits)):
        raise SpecError("spec.resources", MSG_OWN_RESOURCES)
    b = s.disruption_budget
    if b is not None and (b.max_unavailable is None) == (b.min_available is None):
        raise SpecError("spec.disruptionBudget", MSG_DISRUPTION_BUDGET)
    _check_pod(s.worker_pod, "spec.workerPod")
    _check_pod(s.gateway.pod, "spec.gateway.pod")


def _check_pod(pod: PodOverride, path: str) -> None:
    """The CRD's rules on a pod override (workerPod, gateway.pod), in its order: the node's own rule, then its
    fields' in schema order."""
    volumes = [v.name for v in pod.volumes]
    if any(m.name not in volumes for m in pod.volume_mounts):
        raise SpecError(f"{path}.volumeMounts", MSG_MOUNT_VOLUME)
    if any(k.startswith(RESERVED_LABEL_PREFIXES) for k in pod.labels):
        raise SpecError(f"{path}.labels", MSG_RESERVED_LABELS)
    for i, t in enumerate(pod.tolerations):
        if t.operator == "Exists" and t.value is not None:
            raise SpecError(f"{path}.tolerations[{i}]", MSG_TOLERATION_EXISTS)
        if t.toleration_seconds is not None and t.effect != "NoExecute":
            raise SpecError(f"{path}.tolerations[{i}]", MSG_TOLERATION_SECONDS)
    names = [e.name for e in pod.env]
    if any(n in RESERVED_ENV for n in names):
        raise SpecError(f"{path}.env", MSG_RESERVED_ENV)
    if len(set(names)) != len(names):
        raise SpecError(f"{path}.env", MSG_UNIQUE_ENV)
    for i, e in enumerate(pod.env):
        if e.value is not None and e.value_from is not None:
            raise SpecError(f"{path}.env[{i}]", MSG_ENV_VALUE)
    if any(v in RESERVED_VOLUMES for v in volumes):
        raise SpecError(f"{path}.volumes", MSG_RESERVED_VOLUME)
    if len(set(volumes)) != len(volumes):
        raise SpecError(f"{path}.volumes", MSG_UNIQUE_VOLUMES)
    if any(m.mount_path in RESERVED_MOUNTS or m.mount_path == RESERVED_MOUNT_PREFIX or
           m.mount_path.startswith(RESERVED_MOUNT_PREFIX + "/") for m in pod.volume_mounts):
        raise SpecError(f"{path}.volumeMounts", MSG_RESERVED_MOUNT)


def _path(loc: tuple[int | str, ...]) -> str:
    out = "spec"
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in ("int", "str"):  # the branch of a union pydantic tried, not a field
            continue
        else:
            out += f".{part}"
    return out


def _message(error: Mapping[str, Any]) -> str:
    if error["type"] == "missing":
        return "required"
    if error["type"] == "extra_forbidden":
        return "unknown field"
    if error["type"] == "value_error":
        return str(error["ctx"]["error"])
    return str(error["msg"])
