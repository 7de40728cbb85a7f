"""adaserve/redis_client.py against real redis-servers: credentials accepted, refused (a clear message, never the
password), an unreachable Redis (an outage, not a setting), and the password kept out of reprs."""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Iterator
from pathlib import Path

import pytest

from adaserve.redis_client import RedisAuth, _certificate_failure, check_credentials, connect, where
from adaserve.server_process import free_port
from tests.private_redis import PrivateRedis, private_redis

PASSWORD = "pw-for-tests"


@pytest.fixture(scope="module")
def locked(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PrivateRedis]:
    yield from private_redis(tmp_path_factory, "redis-client", password=PASSWORD)


def test_the_right_password_is_accepted_and_the_client_works(locked: PrivateRedis) -> None:
    async def go() -> tuple[str | None, bytes | None]:
        verdict = await check_credentials(locked.url, RedisAuth(password=PASSWORD))
        client = connect(locked.url, RedisAuth(password=PASSWORD), timeout_s=2)
        try:
            await client.set("k", "v")
            return verdict, await client.get("k")
        finally:
            await client.aclose()

    assert asyncio.run(go()) == (None, b"v")


@pytest.mark.parametrize("auth", [RedisAuth(password="wrong"), RedisAuth(), RedisAuth(password=PASSWORD,
                                                                                      username="nobody")],
                         ids=["wrong password", "no password", "unknown user"])
def test_refused_credentials_are_a_message_naming_the_redis(locked: PrivateRedis, auth: RedisAuth) -> None:
    message = asyncio.run(check_credentials(locked.url, auth))
    assert message is not None and message.startswith(f"Redis at 127.0.0.1:{locked.port} refused the credentials: ")
    assert PASSWORD not in message and "wrong" not in message


def test_an_unreachable_redis_is_not_a_credentials_problem() -> None:
    url = f"redis://127.0.0.1:{free_port()}/0"
    assert asyncio.run(check_credentials(url, RedisAuth(password="x"), timeout_s=1)) is None


def test_a_certificate_that_does_not_verify_is_recognised_through_the_drivers_wrapping() -> None:
    cause = ssl.SSLCertVerificationError(1, "[SSL: CERTIFICATE_VERIFY_FAILED] certificate verify failed")
    wrapped = ConnectionError("Error connecting")
    wrapped.__cause__ = cause
    assert _certificate_failure(wrapped) and not _certificate_failure(ConnectionError("refused"))


def test_the_password_never_shows_in_a_repr(tmp_path: Path) -> None:
    auth = RedisAuth(password=PASSWORD, username="svc", ca_data="-----BEGIN")
    assert PASSWORD not in repr(auth) and "BEGIN" not in repr(auth) and "svc" in repr(auth)
    assert where("redis://:x@redis.example:6380/0") == "redis.example:6380"
    assert where("unix:///run/redis.sock") == "/run/redis.sock"
