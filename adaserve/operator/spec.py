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

from pydantic import BaseModel, ConfigDict, Field, PlainValidator, ValidationError
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
    tensor_parallel_size: int | None = Field(None, ge=1, le=16)  # unset: 1
    shm_size: Quantity | None = None  # the /dev/shm of a tensor-parallel worker (builders.DEFAULT_SHM_SIZE)
    memory: Quantity | None = None
    cpu: Quantity | None = None

    @property
    def ranks(self) -> int:
        """The worker's tensor-parallel size: ``tensorParallelSize``, else 1."""
        return self.tensor_parallel_size or 1


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


class Redis(_Model):
    managed: bool = False
    image: str = "redis:7-alpine"
    url: str | None = Field(None, pattern=REDIS_URL)


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
