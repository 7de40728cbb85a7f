"""The operator's own settings, from ``ADASERVE_OPERATOR_*`` environment variables (kopf's flags do the rest)."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping


@dataclasses.dataclass(frozen=True)
class OperatorConfig:
    # how often each resource's status is refreshed and its children checked for drift
    resync_s: float = 15.0
    # how long one status refresh may wait on Redis; past it the status has no worker details and,
    # unless a managed Redis is still starting, says Degraded/RedisUnreachable
    redis_timeout_s: float = 1.0
    # read the Redis password (and CA) Secrets a resource names, to read its workers' registrations for the status;
    # needs RBAC get on secrets (the chart's rbac.readSecrets). Off: such resources show no status.workers.
    read_secrets: bool = False

    def __post_init__(self) -> None:
        if not self.resync_s > 0:
            raise ValueError(f"resync_s must be > 0, got {self.resync_s}")
        if not self.redis_timeout_s > 0:
            raise ValueError(f"redis_timeout_s must be > 0, got {self.redis_timeout_s}")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> OperatorConfig:
        env = os.environ if env is None else env
        try:
            return cls(resync_s=float(env.get("ADASERVE_OPERATOR_RESYNC_S", cls.resync_s)),
                       redis_timeout_s=float(env.get("ADASERVE_OPERATOR_REDIS_TIMEOUT_S", cls.redis_timeout_s)),
                       read_secrets=_flag(env.get("ADASERVE_OPERATOR_READ_SECRETS", "false")))
        except ValueError as e:
            raise ValueError(f"ADASERVE_OPERATOR_*: {e}") from None


def _flag(value: str) -> bool:
    if value.lower() not in ("true", "false", "1", "0"):
        raise ValueError(f"ADASERVE_OPERATOR_READ_SECRETS must be true or false, got {value!r}")
    return value.lower() in ("true", "1")
