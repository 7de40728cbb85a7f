"""Opening Redis the one way every service does: the URL, its AUTH credentials and TLS CA, and the start-up check
that the credentials are accepted.

The worker, the gateway and the operator each talk to the same Redis (docs/k8s-contract.md); the password never
travels in the URL (the URL is in the pods' env in clear and in logs), but as its own setting from a Secret.
TLS is the URL's scheme (``rediss://``); a private CA comes as a file (the services, from a mounted Secret) or as
PEM text (the operator, which reads the Secret itself). A leaf: only the Redis driver and the standard library.
The driver is imported when a client is made: a worker in local mode (no Redis) reads ``RedisAuth`` in its
settings and never holds redis-py's modules (issue 35's resident memory).
"""

from __future__ import annotations

import dataclasses
import ssl
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

if TYPE_CHECKING:
    import redis.asyncio as aioredis

# what Redis answers a client without the right credentials (redis-py raises some of these as ResponseError)
REFUSALS = ("NOAUTH", "WRONGPASS", "invalid password", "invalid username-password", "AUTH", "NOPERM")


@dataclasses.dataclass(frozen=True)
class RedisAuth:
    """Credentials and TLS trust for one Redis; all optional (a Redis without AUTH on a private network)."""

    password: str | None = None
    username: str | None = None
    ca_file: str | None = None  # PEM file of the CA that signed the server's certificate (rediss:// only)
    ca_data: str | None = None  # the same as PEM text

    def __repr__(self) -> str:  # never the password, in a log line or a traceback
        return (f"RedisAuth(password={'***' if self.password else None}, username={self.username!r}, "
                f"ca_file={self.ca_file!r}, ca_data={'<pem>' if self.ca_data else None})")


def connect(url: str, auth: RedisAuth | None = None, *, timeout_s: float, **options: Any) -> aioredis.Redis:
    """A client for ``url`` with ``auth``; ``options`` go to redis-py as they are (decode_responses, ...)."""
    import redis.asyncio as aioredis

    auth = auth or RedisAuth()
    if auth.password is not None:
        options["password"] = auth.password
    if auth.username is not None:
        options["username"] = auth.username
    if auth.ca_file is not None:
        options["ssl_ca_certs"] = auth.ca_file
    if auth.ca_data is not None:
        options["ssl_ca_data"] = auth.ca_data
    return aioredis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s, **options)


def where(url: str) -> str:
    """``HOST:PORT`` (or the socket path) of a Redis URL: which Redis, never its password."""
    parts = urlsplit(url)
    return parts.path if parts.scheme == "unix" else f"{parts.hostname or '?'}:{parts.port or 6379}"


async def check_credentials(url: str, auth: RedisAuth, *, timeout_s: float = 5.0) -> str | None:
    """Why Redis refuses these credentials or this TLS trust, or None: accepted, or not reachable now.

    An unreachable Redis is an outage the services ride out (they retry); refused credentials or a certificate
    that does not verify are settings that no retry fixes, so a service stops at start with this message.
    """
    from redis.exceptions import AuthenticationError, RedisError, ResponseError

    client = connect(url, auth, timeout_s=timeout_s)
    try:
        await client.ping()
    except AuthenticationError as e:
        return f"Redis at {where(url)} refused the credentials: {e}"
    except ResponseError as e:
        if any(r in str(e) for r in REFUSALS):
            return f"Redis at {where(url)} refused the credentials: {e}"
        return None
    except (RedisError, OSError) as e:
        if _certificate_failure(e):
            return f"Redis at {where(url)}: TLS certificate not trusted: {e}"
        return None
    finally:
        await client.aclose()
    return None


def _certificate_failure(error: BaseException) -> bool:
    seen: BaseException | None = error
    while seen is not None:
        if isinstance(seen, ssl.SSLCertVerificationError) or "CERTIFICATE_VERIFY_FAILED" in str(seen):
            return True
        seen = seen.__cause__ or seen.__context__
    return False
