"""The Redis every service is configured with: its URL, and the key prefix they share.

Workers register under the prefix, gateways read the registrations and keep their records under it, and
the operator gives both the same one (docs/k8s-contract.md).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated
from urllib.parse import urlsplit, urlunsplit

from pydantic import AfterValidator, BaseModel, Field, SecretStr

SCHEMES = ("redis://", "rediss://", "unix://")
DEFAULT_PREFIX = "adaserve"


def _redis_url(v: str) -> str:
    if not v.startswith(SCHEMES):
        raise ValueError(f"must start with {', '.join(SCHEMES[:-1])} or {SCHEMES[-1]}")
    return v


RedisUrl = Annotated[str, AfterValidator(_redis_url)]
RedisPrefix = Annotated[str, Field(min_length=1)]


class RedisAuthFields(BaseModel):
    """The Redis AUTH and TLS settings of every service (workers and gateways mix them into their settings; the
    operator fills them from a Secret). Checked against the URL by :func:`check_auth`."""

    redis_password: SecretStr | None = Field(None, description="Redis AUTH password (the operator sets it from a "
                                             "Secret); keep it out of the URL")
    redis_username: str | None = Field(None, min_length=1, description="an ACL user (Redis 6+), with the password")
    redis_tls_ca_file: Path | None = Field(None, description="PEM file of the CA that signed the Redis server's "
                                           "certificate (rediss:// URLs; default: the system's CAs)")


def check_auth(url: str | None, *, password: str | None, username: str | None, ca_file: Path | None,
               prefix: str) -> None:
    """The Redis AUTH and TLS settings agree with the URL; ValueError naming the variables (``prefix`` is the
    service's, ``ADASERVE_`` or ``ADASERVE_GATEWAY_``) otherwise."""
    given = [n for n, v in (("REDIS_PASSWORD", password), ("REDIS_USERNAME", username),
                            ("REDIS_TLS_CA_FILE", ca_file)) if v is not None]
    if url is None:
        if given:
            raise ValueError(f"{prefix}{given[0]} is set but there is no Redis URL ({prefix}REDIS_URL)")
        return
    parts = urlsplit(url)
    if password is not None and parts.password is not None:
        raise ValueError(f"the Redis password is both in {prefix}REDIS_URL and in {prefix}REDIS_PASSWORD: "
                         "keep it out of the URL")
    if username is not None and password is None:
        raise ValueError(f"{prefix}REDIS_USERNAME needs {prefix}REDIS_PASSWORD (an ACL user signs in with both)")
    if ca_file is not None:
        if parts.scheme != "rediss":
            raise ValueError(f"{prefix}REDIS_TLS_CA_FILE needs a rediss:// URL (the scheme turns TLS on)")
        if not ca_file.is_file():
            raise ValueError(f"{prefix}REDIS_TLS_CA_FILE {ca_file} is not a readable file")


def redacted(url: str) -> str:
    """The URL without its password, for logs."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.hostname or ""
    netloc = f"{parts.username or ''}:***@{host}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))
