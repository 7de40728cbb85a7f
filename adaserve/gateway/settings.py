"""The gateway's one settings object: command-line options over ``ADASERVE_GATEWAY_*`` environment variables."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from adaserve.body_limit import DEFAULT_MAX_BODY_BYTES
from adaserve.contract.redis_settings import DEFAULT_PREFIX, RedisAuthFields, RedisPrefix, RedisUrl, check_auth
from adaserve.redis_client import RedisAuth

Routing = Literal["headroom", "least-loaded", "round-robin"]
AdmissionMode = Literal["slo", "none"]
OnOverload = Literal["best-effort", "refuse"]


class GatewaySettings(BaseSettings, RedisAuthFields):
    """Every knob of a gateway. Environment variable = ``ADASERVE_GATEWAY_`` + the field name in capitals."""

    model_config = SettingsConfigDict(env_prefix="ADASERVE_GATEWAY_", env_ignore_empty=True, extra="ignore",
                                      validate_default=True)

    host: str = "127.0.0.1"
    port: int = Field(8080, ge=0, le=65535, description="0 = any free port")
    log_level: Literal["critical", "error", "warning", "info", "debug"] = "info"

    # where workers and state live
    redis_url: RedisUrl | None = Field(None, description="redis://host:port/db; unset: in-process state, static URLs")
    redis_prefix: RedisPrefix = Field(DEFAULT_PREFIX, description="the workers' prefix; records live under it too")
    worker_token: SecretStr | None = Field(None, description="the token workers require (their ADASERVE_AUTH_TOKEN), "
                                           "sent to them as Authorization: Bearer")
    workers: list[str] = Field(default_factory=list, description="worker URLs polled at /v1/status (no Redis needed)")
    model_name: str | None = Field(None, description="the only model served (default: what the workers publish)")

    # SLO classes and API keys
    slo_classes_file: Path | None = Field(None, description="JSON list of classes (the operator's ConfigMap)")
    slo_classes: str | None = Field(None, description="the same JSON inline; default: coding/chat/summarization")
    default_slo_class: str | None = Field(None, description="class of requests that name none (default: first)")
    api_keys_file: Path | None = Field(None, description='JSON {"keys": [...]}; unset = no authentication')

    # routing and admission
    routing: Routing = "headroom"
    prefix_index_blocks: int = Field(
        32768, ge=0, description="prefix affinity (gateway/prefix_index.py): per worker, how many blocks of the "
                                 "text recently sent to it the gateway remembers, to send a request to the worker "
                                 "with headroom that holds the longest prefix of it; 0: off")
    prefix_block_chars: int = Field(64, ge=1, le=4096, description="characters per block of prefix affinity")
    admission: AdmissionMode = Field(
        "slo", description="slo: admit where every target should hold, queue or shed otherwise; none: a plain "
                           "load balancer (any free slot, at once)")
    slo_margin: float = Field(0.1, ge=0, lt=1, description="admit only where the predicted TPOT is at least this "
                              "share under the target (the prediction's own noise); feasibility is judged so too")
    queue_timeout_s: float = Field(2.0, ge=0, description="how long a request waits for headroom before 503")
    shed_window_s: float = Field(30.0, ge=0, description="after a non-sheddable request had to wait or was refused "
                                 "for want of headroom, its class stays reserved this long: a sheddable request "
                                 "goes only where one request of that class would still fit beside it (0: only "
                                 "while one waits)")
    max_queued: int = Field(64, ge=0, description="requests waiting for headroom at once; beyond it 503 at once")
    on_overload: OnOverload = Field(
        "refuse", description="a non-sheddable request still without headroom when its wait is over: refuse it "
                              "with 503 (refuse) or serve it late, slowing the batch it joins (best-effort)")
    on_infeasible: OnOverload = Field(
        "best-effort", description="a class no worker can meet even for a lone request: serve it as fast as a "
                                   "worker can without breaking the others' targets (best-effort), or 503 (refuse)")
    max_attempts: int = Field(3, ge=1, description="workers tried before the first token (1 = no retry); also "
                              "the most times a request is continued on another worker after its worker failed")
    worker_wait_s: float = Field(30.0, ge=0, description="how long a request whose worker drained or failed waits "
                                 "for another when none is usable (a restart), before 503")
    retry_after_s: int = Field(1, ge=1)
    rate_limit_fail_open: bool = Field(False, description="with the state store unreachable, serve rate-limited keys "
                                       "unchecked; default: refuse them, 503 state_store_unavailable")
    strict_openai_fields: bool = Field(False, description="refuse a request body with a field adaserve does not "
                                       "know with 400; default: accept it, ignore the field and name it in the "
                                       "X-Ignored-Fields header, as vLLM does")
    refresh_s: float = Field(0.5, gt=0, description="how often the worker list is re-read")
    suspect_s: float = Field(5.0, ge=0, description="how long a worker that failed a request is skipped")
    connect_timeout_s: float = Field(2.0, gt=0)
    first_token_timeout_s: float = Field(120.0, gt=0, description="worker silence before the first token")
    token_timeout_s: float = Field(60.0, gt=0, description="worker silence between tokens")
    record_ttl_s: int = Field(86400, ge=1, description="how long request records stay in the state store")
    max_tokens_default: int = Field(64, ge=1, description="max_tokens of a request that gives none")
    max_body_bytes: int = Field(DEFAULT_MAX_BODY_BYTES, ge=1024, description="larger request bodies get 413, "
                                "refused before they are read in full")

    @model_validator(mode="after")
    def _consistent(self) -> GatewaySettings:
        check_auth(self.redis_url, password=_secret(self.redis_password), username=self.redis_username,
                   ca_file=self.redis_tls_ca_file, prefix="ADASERVE_GATEWAY_")
        for url in self.workers:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"worker URL {url!r} must start with http:// or https://")
        self.workers = [u.rstrip("/") for u in self.workers]
        if self.slo_classes_file is not None and self.slo_classes is not None:
            raise ValueError("give slo_classes_file or slo_classes, not both")
        return self

    @property
    def redis_auth(self) -> RedisAuth:
        return RedisAuth(password=_secret(self.redis_password), username=self.redis_username,
                         ca_file=str(self.redis_tls_ca_file) if self.redis_tls_ca_file else None)


def _secret(value: SecretStr | None) -> str | None:
    return value.get_secret_value() if value is not None else None
