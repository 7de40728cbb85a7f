"""The Redis URL every service takes, and how it shows in logs."""

from __future__ import annotations

import pytest
from pydantic import TypeAdapter, ValidationError

from adaserve.contract.redis_settings import RedisUrl, redacted


@pytest.mark.parametrize("url", ["redis://r:6379/0", "rediss://u:p@r/1", "unix:///run/redis.sock"])
def test_redis_urls_accepted(url: str) -> None:
    assert TypeAdapter(RedisUrl).validate_python(url) == url


@pytest.mark.parametrize("url", ["localhost:6379", "http://r:6379", ""])
def test_other_urls_refused(url: str) -> None:
    with pytest.raises(ValidationError, match="must start with redis://, rediss:// or unix://"):
        TypeAdapter(RedisUrl).validate_python(url)


def test_redacted_hides_only_the_password() -> None:
    assert redacted("redis://:s3cret@redis:6379/0") == "redis://:***@redis:6379/0"
    assert redacted("rediss://admin:s3cret@redis/2") == "rediss://admin:***@redis/2"
    assert redacted("redis://127.0.0.1:6379/0") == "redis://127.0.0.1:6379/0"
