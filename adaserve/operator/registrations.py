"""Reading the workers' registrations from Redis, briefly: the status must never wait on a slow Redis.

The reading itself is the one every reader shares (adaserve/contract/registry.py); this adds the time limit
and says why when Redis cannot be read.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from typing import Any
from urllib.parse import urlsplit

from redis.exceptions import RedisError

from adaserve.contract.redis_settings import redacted
from adaserve.contract.registry import read_registrations
from adaserve.operator.status import worker_entries
from adaserve.redis_client import RedisAuth, connect, where

log = logging.getLogger(__name__)
MAX_ERROR_CHARS = 300  # a condition message is read by humans; a driver's error can be long


@dataclasses.dataclass(frozen=True)
class WorkersRead:
    """One read's outcome: the entries, or (``workers`` None) why Redis could not be read."""

    workers: list[dict[str, Any]] | None
    error: str | None = None


async def read_workers(url: str, prefix: str, *, timeout_s: float, auth: RedisAuth | None = None) -> WorkersRead:
    """status.workers entries of the live workers, or the reason Redis could not be read in time.

    Never raises: an unreachable Redis is a status to report (status.compute decides when it is a
    problem: a managed Redis that is still starting is none), not a reason to fail the handler.
    """
    client = connect(url, auth, timeout_s=timeout_s)
    try:
        async with asyncio.timeout(2 * timeout_s):  # both calls together, whatever the retries inside
            registrations = await read_registrations(client, prefix)
    except (RedisError, OSError, TimeoutError) as e:
        log.debug("cannot read registrations from %s: %s", redacted(url), e)
        return WorkersRead(None, describe_failure(url, e, timeout_s=2 * timeout_s))
    finally:
        await client.aclose()
    return WorkersRead(worker_entries(registrations))


def describe_failure(url: str, error: BaseException, *, timeout_s: float) -> str:
    """``Redis at HOST:PORT: <error>`` for the status: the host says which Redis, never the password."""
    parts = urlsplit(url)
    # asyncio's timeout carries no text; a driver's error could in theory echo the URL back
    text = str(error) or f"{type(error).__name__} after {timeout_s:g} s"
    if parts.password:
        text = text.replace(parts.password, "***")
    if len(text) > MAX_ERROR_CHARS:
        text = text[:MAX_ERROR_CHARS - 3] + "..."
    return f"Redis at {where(url)}: {text}"
