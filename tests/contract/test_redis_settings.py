"""The Redis URL every service takes, how it shows in logs, and the AUTH/TLS settings that go with it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from pydantic import TypeAdapter, ValidationError

from adaserve.contract.redis_settings import RedisUrl, check_auth, redacted


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


def test_auth_settings_that_agree_with_the_url_pass(tmp_path: Path) -> None:
    ca = tmp_path / "ca.crt"
    ca.write_text("-----BEGIN CERTIFICATE-----\n")
    check_auth("redis://r:6379/0", password="p", username=None, ca_file=None, prefix="ADASERVE_")
    check_auth("rediss://r:6380/0", password="p", username="svc", ca_file=ca, prefix="ADASERVE_")
    check_auth(None, password=None, username=None, ca_file=None, prefix="ADASERVE_")  # local mode


@pytest.mark.parametrize(("url", "given", "words"), [
    (None, {"password": "p"}, "ADASERVE_GATEWAY_REDIS_PASSWORD is set but there is no Redis URL"),
    ("redis://:inurl@r/0", {"password": "p"}, "keep it out of the URL"),
    ("redis://r/0", {"username": "svc"}, "ADASERVE_GATEWAY_REDIS_USERNAME needs ADASERVE_GATEWAY_REDIS_PASSWORD"),
    ("redis://r/0", {"ca_file": "ca"}, "needs a rediss:// URL"),
    ("rediss://r/0", {"ca_file": "missing"}, "is not a readable file"),
])
def test_auth_settings_that_disagree_are_named(tmp_path: Path, url: str | None, given: dict[str, str],
                                               words: str) -> None:
    if "ca_file" in given and given["ca_file"] == "ca":
        (tmp_path / "ca").write_text("pem")
    kwargs: dict[str, Any] = {"password": None, "username": None, "ca_file": None, **given}
    if kwargs["ca_file"] is not None:
        kwargs["ca_file"] = tmp_path / kwargs["ca_file"]
    with pytest.raises(ValueError, match=words):
        check_auth(url, prefix="ADASERVE_GATEWAY_", **kwargs)
