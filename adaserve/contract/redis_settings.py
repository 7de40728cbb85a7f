"""The Redis every service is configured with: its URL, and the key prefix they share.

Workers register under the prefix, gateways read the registrations and keep their records under it, and
the operator gives both the same one (docs/k8s-contract.md).
"""

from __future__ import annotations

from typing import Annotated
from urllib.parse import urlsplit, urlunsplit

from pydantic import AfterValidator, Field

SCHEMES = ("redis://", "rediss://", "unix://")
DEFAULT_PREFIX = "adaserve"


def _redis_url(v: str) -> str:
    if not v.startswith(SCHEMES):
        raise ValueError(f"must start with {', '.join(SCHEMES[:-1])} or {SCHEMES[-1]}")
    return v


RedisUrl = Annotated[str, AfterValidator(_redis_url)]
RedisPrefix = Annotated[str, Field(min_length=1)]


def redacted(url: str) -> str:
    """The URL without its password, for logs."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.hostname or ""
    netloc = f"{parts.username or ''}:***@{host}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))
