"""The worker's one settings object: command-line options over ``ADASERVE_*`` environment variables.

The operator configures workers through the environment (a ConfigMap); a person running one by hand
uses the command line. Both end up here and are validated once, before any model is loaded.
"""

from __future__ import annotations

import socket
from pathlib import PurePath
from typing import Literal

from pydantic import Field, SecretStr, ValidationInfo, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from adaserve.body_limit import DEFAULT_MAX_BODY_BYTES
from adaserve.contract.redis_settings import DEFAULT_PREFIX, RedisAuthFields, RedisPrefix, RedisUrl, check_auth
from adaserve.contract.slo import CLASS_NAME, SloClassName
from adaserve.engine.loading.catalog import DEFAULT_MODEL, NAMES, check_ref, served_name
from adaserve.engine.speculation.draft_bandit import pinned_draft
from adaserve.engine.speculation.policies import split_policy
from adaserve.redis_client import RedisAuth


class WorkerSettings(BaseSettings, RedisAuthFields):
    """Every knob of a worker. Environment variable = ``ADASERVE_`` + the field name in capitals."""

    model_config = SettingsConfigDict(env_prefix="ADASERVE_", env_ignore_empty=True, extra="ignore",
                                      validate_default=True)

    # models and engine
    target: str = Field(DEFAULT_MODEL, description="target model: a name (smollm2-135m-instruct, demo-tiny), a "
                        ".gguf file or a Hugging Face directory; a named model brings its own draft")
    draft: str | None = Field(None, description="draft model (same forms); speculative policies need one")
    drafts: list[str] = Field(default_factory=list, description="several drafts (same forms, or smollm2-draft, "
                              "smollm2-draft-small), instead of draft: each request's draft is then chosen per "
                              "slot by the policy's selector (POLICY@ucb|eps|length|dN, spin); JSON list in "
                              "ADASERVE_DRAFTS")
    model_name: str | None = Field(None, description="name published to the gateway (default: the model's name, "
                                   "the GGUF file's stem or the directory's name)")
    device: Literal["cpu", "cuda"] = "cpu"
    tensor_parallel_size: int = Field(1, ge=1, description="shard the target over N ranks, one process per device "
                                      "(CUDA: devices 0..N-1, NCCL; CPU: gloo); the drafts run whole on rank 0")
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = "auto"
    weights: Literal["float", "int8", "int4", "auto"] = Field(
        "auto", description="how the decoder's linear layers are served: float, int8 or int4 weight-only, or auto "
        "(the default: a GGUF model's own precision on a CPU, Q4 blocks as int4 and Q8_0 as int8, the fastest "
        "there; float on a GPU; a directory model as stored); docs/models.md")
    policy: str = "adaserve"
    max_depth: int | None = Field(None, ge=1, le=32, description="deepest draft tree (adaptive policies)")
    max_width: int | None = Field(None, ge=1, le=16, description="widest beam (adaptive policies)")
    budget: int | None = Field(None, ge=1, description="fixed tokens per verification; skips profiling")
    attention: Literal["auto", "torch", "flashinfer"] = "auto"
    kv_memory_mb: int = Field(256, ge=1, description="KV cache memory per model")
    kv_memory_fraction: float | None = Field(
        None, gt=0, le=1, description="size the KV caches from the device's memory instead of kv_memory_mb: on CUDA "
        "this fraction of the device's total memory less what it holds after loading and a profiling forward; on CPU "
        "this fraction of available RAM, at most 16 GiB (as vLLM's gpu_memory_utilization)")
    enable_prefix_caching: bool = Field(True, description="reuse the KV of cached prompt prefixes (full pages of "
                                        "earlier requests' prompts and answers) instead of prefilling them again")
    static_shapes: bool | None = Field(None, description="decode, beam and verification forwards on padded static "
                                       "buffers, replayed as CUDA graphs on a GPU; default: on for CUDA (one rank), "
                                       "off on CPU, where the eager path is faster")
    reprofile: bool = Field(False, description="ignore the cached profile and measure again")
    torch_threads: int | None = Field(None, ge=1, description="torch CPU threads (default: torch's own)")
    warmup: bool = True

    # HTTP
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=1, le=65535)
    advertise_url: str | None = Field(None, description="address published in Redis (default http://host:port)")
    worker_id: str = Field("", description="unique id in the registry (default: hostname-port)")
    log_level: Literal["critical", "error", "warning", "info", "debug"] = "info"

    # requests
    max_active_requests: int = Field(64, ge=1, description="queued + running requests before 503")
    retry_after_s: int = Field(1, ge=1, description="Retry-After sent with 503 answers")
    default_max_tokens: int = Field(64, ge=1)
    max_tokens_limit: int = Field(4096, ge=1, description="largest max_tokens a request may ask for")
    max_body_bytes: int = Field(DEFAULT_MAX_BODY_BYTES, ge=1024, description="larger request bodies get 413, "
                                "refused before they are read in full")
    slo_classes: dict[str, float] = Field(
        default_factory=dict,
        description='JSON {"class": tpot_ms}; when set, only these classes are accepted and give the default TPOT',
    )
    default_slo_class: SloClassName = "default"

    # registration and shutdown
    redis_url: RedisUrl | None = Field(None, description="redis://host:port/db; unset = local mode, no registration")
    redis_prefix: RedisPrefix = Field(DEFAULT_PREFIX, description="key prefix; tests isolate themselves with it")
    auth_token: SecretStr | None = Field(None, description="require this token (Authorization: Bearer) on every "
                                         "route but /healthz, /readyz and /metrics; the gateway sends it")
    heartbeat_s: float = Field(2.0, gt=0)
    registration_ttl_s: float = Field(10.0, gt=0)
    drain_grace_s: float = Field(30.0, ge=0, description="how long SIGTERM waits for in-flight requests")

    @field_validator("target", "draft", mode="before")
    @classmethod
    def _path_as_text(cls, v: object) -> object:
        return str(v) if isinstance(v, PurePath) else v

    @field_validator("target", "draft")
    @classmethod
    def _model_ref(cls, v: str | None) -> str | None:
        if v is not None:
            check_ref(v)  # ModelNotFoundError is a ValueError: a one-line settings error
        return v

    @field_validator("tensor_parallel_size")
    @classmethod
    def _tensor_parallel(cls, v: int, info: ValidationInfo) -> int:
        target = info.data.get("target")
        if v > 1 and target is not None:
            from adaserve.engine.ranks import check_size

            check_size(target, v)  # no more ranks than the model has heads: refused before anything loads
        return v

    @field_validator("drafts", mode="before")
    @classmethod
    def _paths_as_text(cls, v: object) -> object:
        return [str(d) if isinstance(d, PurePath) else d for d in v] if isinstance(v, list | tuple) else v

    @field_validator("drafts")
    @classmethod
    def _draft_refs(cls, v: list[str]) -> list[str]:
        for d in v:
            check_ref(d)
        if len(set(v)) != len(v):
            raise ValueError("a draft is named twice: each draft may appear once")
        return v

    @field_validator("slo_classes")
    @classmethod
    def _classes(cls, v: dict[str, float]) -> dict[str, float]:
        for name, tpot in v.items():
            if not CLASS_NAME.match(name):
                raise ValueError(f"SLO class name {name!r} must match {CLASS_NAME.pattern}")
            if not tpot > 0:
                raise ValueError(f"SLO class {name!r}: tpot_ms must be positive, got {tpot}")
        return v

    @model_validator(mode="after")
    def _consistent(self) -> WorkerSettings:
        check_auth(self.redis_url, password=_secret(self.redis_password), username=self.redis_username,
                   ca_file=self.redis_tls_ca_file, prefix="ADASERVE_")
        if self.auth_token is not None and not self.auth_token.get_secret_value().strip():
            raise ValueError("ADASERVE_AUTH_TOKEN is empty: unset it, or give a token")
        if self.registration_ttl_s <= self.heartbeat_s:
            raise ValueError("registration_ttl_s must be longer than heartbeat_s, or the entry flickers")
        if self.default_max_tokens > self.max_tokens_limit:
            raise ValueError("default_max_tokens must be <= max_tokens_limit")
        if self.draft is not None and self.drafts:
            raise ValueError("set draft or drafts, not both (drafts lists every draft, the first one included)")
        if self.target not in NAMES and not self.draft_refs and self.policy != "incremental":
            # refused before loading: a .gguf target would otherwise be converted first, for nothing
            raise ValueError(f"policy {self.policy} speculates and target {self.target} brings no draft: "
                             "set draft (or drafts), or policy incremental")
        pinned = pinned_draft(split_policy(self.policy)[1] or "")
        if len(self.draft_refs) > 1 and pinned is not None and pinned >= len(self.draft_refs):
            raise ValueError(f"policy {self.policy} pins draft {pinned}, but there are "
                             f"{len(self.draft_refs)} drafts (d0..d{len(self.draft_refs) - 1})")
        if not self.worker_id:
            self.worker_id = f"{socket.gethostname()}-{self.port}"
        return self

    @property
    def draft_refs(self) -> list[str]:
        """Every draft the worker was given, the one it profiles first: ``drafts``, else ``draft``, else none
        (a named target then brings its own)."""
        return list(self.drafts) or ([self.draft] if self.draft is not None else [])

    @property
    def redis_auth(self) -> RedisAuth:
        return RedisAuth(password=_secret(self.redis_password), username=self.redis_username,
                         ca_file=str(self.redis_tls_ca_file) if self.redis_tls_ca_file else None)

    @property
    def address(self) -> str:
        if self.advertise_url:
            return self.advertise_url.rstrip("/")
        host = socket.gethostname() if self.host in ("0.0.0.0", "::", "") else self.host
        return f"http://{host}:{self.port}"

    @property
    def served_model_name(self) -> str:
        return self.model_name or served_name(self.target)


def _secret(value: SecretStr | None) -> str | None:
    return value.get_secret_value() if value is not None else None
