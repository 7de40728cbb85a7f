"""API keys: who may call, their default SLO class, and their token-bucket rate limit.

File (a Kubernetes Secret mounted as a file)::

    {"keys": [{"key": "sk-team-a-...", "name": "team-a", "defaultClass": "chat", "ratePerS": 5, "burst": 10},
              {"key": "sk-ops-...", "name": "ops", "admin": true}]}

A request's record (``GET /v1/requests/{id}``) is visible to the key that made it and to ``admin`` keys only.

No file = no authentication and no rate limit, like a local vLLM server.
"""

from __future__ import annotations

import hmac
import json
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator


class ApiKey(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True, frozen=True)

    key: str = Field(min_length=8)
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
    default_class: str | None = Field(None, alias="defaultClass")
    rate_per_s: float | None = Field(None, alias="ratePerS", gt=0, allow_inf_nan=False)
    burst: float | None = Field(None, ge=1, allow_inf_nan=False)  # a request takes one token: below 1, never
    admin: bool = False  # may read every key's request records

    @model_validator(mode="after")
    def _bucket(self) -> ApiKey:
        if self.burst is not None and self.rate_per_s is None:
            raise ValueError("burst needs ratePerS")
        return self

    @property
    def bucket_size(self) -> float:
        return self.burst if self.burst is not None else max(1.0, self.rate_per_s or 1.0)


class KeyFile(BaseModel):
    model_config = ConfigDict(extra="forbid")
    keys: list[ApiKey]


class AuthError(Exception):
    pass


@dataclass(frozen=True)
class KeyRing:
    keys: tuple[ApiKey, ...]

    @property
    def enabled(self) -> bool:
        return bool(self.keys)

    def authenticate(self, authorization: str | None) -> ApiKey | None:
        """The caller's key from ``Authorization: Bearer <key>``; None when keys are off."""
        if not self.keys:
            return None
        if not authorization:
            raise AuthError("missing API key: send 'Authorization: Bearer <key>'")
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise AuthError("malformed Authorization header: expected 'Bearer <key>'")
        token = token.strip()
        found = None
        for k in self.keys:  # constant-time per key, and no early exit that leaks which key matched
            if hmac.compare_digest(k.key.encode(), token.encode()):
                found = k
        if found is None:
            raise AuthError("invalid API key")
        return found


def load_keys(file: Path | None, *, classes: list[str]) -> KeyRing:
    if file is None:
        return KeyRing(())
    try:
        parsed = KeyFile.model_validate(json.loads(file.read_text()))
    except OSError as e:
        raise ValueError(f"cannot read API keys file {file}: {e.strerror}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"API keys file {file}: not JSON: {e}") from None
    except ValidationError as e:
        first = e.errors()[0]
        raise ValueError(f"API keys file {file}: [{'.'.join(map(str, first['loc']))}] {first['msg']}") from None
    if not parsed.keys:  # an empty Secret must not quietly turn authentication off
        raise ValueError(f"API keys file {file} lists no keys; leave the file out to turn authentication off")
    names = [k.name for k in parsed.keys]
    if len(set(names)) != len(names) or len({k.key for k in parsed.keys}) != len(names):
        raise ValueError(f"API keys file {file}: key names and keys must be unique")
    for k in parsed.keys:
        if k.default_class is not None and k.default_class not in classes:
            raise ValueError(f"API key {k.name!r}: default class {k.default_class!r} is not one of {classes}")
    return KeyRing(tuple(parsed.keys))
