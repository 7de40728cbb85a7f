"""The document a worker publishes about itself: its Redis entry (registry.py) and its ``GET /v1/status``.

The worker writes it (adaserve/worker/published.py), the gateway routes by it (gateway/directory.py) and
the operator summarises it in the resource's status (operator/status.py); docs/worker.md annotates one.

Readers are lenient where workers of another version may differ (unknown fields are ignored; what a loading
worker cannot know yet is optional) and strict where routing would go wrong (a load or a cost model that is
not numbers): ``parse_registration`` answers None for what is not a registration, so a reader skips that one
worker instead of failing for all of them.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

PositiveMs = Annotated[float, Field(gt=0, allow_inf_nan=False)]

SCHEMA_VERSION = 1


class _Part(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)  # ignore, not forbid: a newer worker may add fields


class CostModel(_Part):
    """One model's forward time in seconds: ``alpha * context tokens + gamma * batched tokens + delta``, plus
    ``beta * cells`` (each request's new tokens times the keys they attend to, its context tokens and its new ones up
    to each, summed; 0 where a worker leaves it out)."""

    alpha: float
    gamma: float
    delta: float
    beta: float = 0.0


class CostModels(_Part):
    source: str | None = None  # "profile" (measured at start) or "online" (learnt from served forwards)
    target: CostModel | None = None
    draft: CostModel | None = None  # None: no draft model


class ModelNames(_Part):
    name: str | None = None  # what clients pass as "model"; None: serves whatever is asked
    target: str | None = None
    draft: str | None = None  # the first (profiled) draft when there are several
    drafts: list[str] = Field(default_factory=list)  # every draft as configured, in order; [] when one or none
    # how the target is served once loaded: "float", or e.g. "int4+int8 on the integer kernels (cpu-kernels-...)"
    weights: str | None = None


class Capacity(_Part):
    max_active_requests: int | None = None
    max_batch: int | None = None


class Load(_Part):
    active: int = 0  # admitted by the worker, not finished
    active_by_class: dict[str, int] = Field(default_factory=dict)
    waiting: int = 0
    running: int = 0
    kv_usage: float = 0.0
    context_tokens: int | None = None  # KV tokens (prompt + output) of the running and waiting requests


class Acceptance(_Part):
    """Over the worker's recent iterations (``steps`` of them)."""

    steps: int = 0
    mean_accepted_per_verification: float = 0.0
    acceptance_rate: float | None = None  # accepted / proposed draft tokens

    @model_validator(mode="after")
    def _rate_once_verified(self) -> Acceptance:
        if self.steps and self.acceptance_rate is None:
            raise ValueError("acceptance_rate is required once steps > 0")
        return self


class ClassAttainment(_Part):
    finished: int
    met: int
    attainment: float


class ClassTokens(_Part):
    """A class's decoding requests in a curve point's iterations: tokens each gained per iteration, on average."""

    tokens: float = Field(ge=0, allow_inf_nan=False)
    decodes: int = Field(ge=1)  # request-iterations the mean is over
    # mean wall time of the iterations those decodes were in (one per decode): what an iteration of this size
    # costs with this class in it (a long summary's context costs more than a short question's); None from a
    # worker that does not measure it
    iteration_ms: float | None = Field(None, gt=0, allow_inf_nan=False)


class IterationPoint(_Part):
    """The worker's recent iterations that held ``requests`` requests (decoding and prefilling): one point of
    its measured iteration-time curve (the last ``steps`` such iterations, refreshed as it serves)."""

    requests: int = Field(ge=1)
    steps: int = Field(ge=1)
    iteration_ms: float = Field(gt=0, allow_inf_nan=False)  # mean wall time of one iteration
    tokens_verified: float = Field(ge=0, allow_inf_nan=False)  # mean tree tokens sent to the target
    # mean tokens a decoding request gained per iteration (accepted draft tokens + the bonus token); None when
    # none of those iterations decoded (prefill only)
    tokens_per_request: float | None = Field(None, ge=0, allow_inf_nan=False)
    tokens_by_class: dict[str, ClassTokens] = Field(default_factory=dict)  # the same, per SLO class


class ClassRecent(_Part):
    """One SLO class over the worker's last ``finished`` finished requests of it."""

    finished: int = Field(ge=1)
    met: int = Field(ge=0)
    attainment: float = Field(ge=0, le=1)
    tpot_ms: float | None = Field(None, ge=0, allow_inf_nan=False)  # mean TPOT of those that had one
    ttft_ms: float | None = Field(None, ge=0, allow_inf_nan=False)  # mean TTFT, from the worker's arrival
    min_ttft_ms: float | None = Field(None, ge=0, allow_inf_nan=False)  # the least of them
    accepted_per_verification: float | None = Field(None, ge=0, allow_inf_nan=False)


class Measured(_Part):
    """What the worker measured while serving (the gateway predicts each class's TPOT from it): iteration time
    against requests per iteration, and each class's recent TPOT, TTFT, attainment and acceptance."""

    iterations: list[IterationPoint] = Field(default_factory=list)  # ascending ``requests``
    classes: dict[str, ClassRecent] = Field(default_factory=dict)


class Profile(_Part):
    """``GET /v1/profile``: budget, cost model and device. A loading worker knows none of it yet."""

    device: str | None = None  # the profiler's device string
    device_type: str | None = None  # "cpu" or "cuda"
    budget: int | None = None  # B, tokens per verification
    budget_source: str | None = None  # "profile", or "fixed" (--budget)
    profile_cached: bool | None = None
    cost_model: CostModels | None = None
    policy: str | None = None
    max_depth: int | None = None  # D, draft steps per iteration at most (0: no speculation)
    max_context: int | None = None
    kv_capacity_tokens: int | None = None  # tokens the KV cache holds (every model's the same), sized at start
    # a lone request's time per token without speculation: one target forward of one token at the profiled
    # context (the profile's measurement, else the cost model's estimate); SLO classes are judged against it
    unloaded_tpot_ms: float | None = None
    # a lone request's time per token as served (speculation included), measured at warm-up on one prompt shaped
    # like each default class's traffic: the median of them, and each class's own
    lone_tpot_ms: float | None = Field(None, gt=0, allow_inf_nan=False)
    lone_tpot_ms_by_class: dict[str, PositiveMs] | None = None


class Registration(Profile):
    # a number where an id or address belongs is still readable as one (hand-written or older entries)
    model_config = ConfigDict(extra="ignore", frozen=True, coerce_numbers_to_str=True, populate_by_name=True)

    schema_version: int = Field(SCHEMA_VERSION, alias="schema")
    worker_id: str = Field(min_length=1)
    address: str = Field(min_length=1)
    status: str  # loading | ready | draining | stopped | failed: only "ready" gets traffic
    version: str | None = None
    models: ModelNames = ModelNames()
    capacity: Capacity = Capacity()
    load: Load = Load()
    acceptance: Acceptance = Acceptance()
    slo_attainment: dict[str, ClassAttainment] = Field(default_factory=dict)
    measured: Measured = Measured()
    slo_classes: dict[str, float] = Field(default_factory=dict)  # class -> TPOT target the worker knows
    started_at: float | None = None  # unix seconds
    updated_at: float | None = None
    heartbeat_s: float | None = None
    ttl_s: float | None = None

    def document(self) -> dict[str, Any]:
        """The JSON object as stored and served, who and what first (for people reading it with redis-cli)."""
        doc = self.model_dump(mode="json", by_alias=True)
        return {**{k: doc[k] for k in _FIRST}, **doc}


_FIRST = ("schema", "worker_id", "address", "status", "version", "models")


def parse_registration(doc: Any) -> Registration | None:
    """``doc`` (decoded JSON) as a registration; None when it is not one (a foreign or broken entry)."""
    try:
        return Registration.model_validate(doc)
    except ValidationError:
        return None
