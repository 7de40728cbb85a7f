"""keys.py: the API key file, Bearer authentication and the rate-limit fields."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from adaserve.gateway.keys import ApiKey, AuthError, KeyRing, load_keys

CLASSES = ["coding", "chat", "summarization"]
TEAM_A = {"key": "sk-team-a-0123456789", "name": "team-a", "defaultClass": "chat", "ratePerS": 5, "burst": 10}
TEAM_B = {"key": "sk-team-b-abcdefghij", "name": "team-b"}


def key_file(tmp_path: Path, *keys: dict[str, Any]) -> Path:
    path = tmp_path / "keys.json"
    path.write_text(json.dumps({"keys": list(keys)}))
    return path


@pytest.fixture
def ring(tmp_path: Path) -> KeyRing:
    return load_keys(key_file(tmp_path, TEAM_A, TEAM_B), classes=CLASSES)


def test_load_reads_every_field(ring: KeyRing) -> None:
    assert ring.enabled
    a, b = ring.keys
    assert (a.name, a.default_class, a.rate_per_s, a.burst, a.bucket_size) == ("team-a", "chat", 5.0, 10.0, 10.0)
    assert (b.name, b.default_class, b.rate_per_s, b.burst) == ("team-b", None, None, None)


def test_bearer_finds_the_key(ring: KeyRing) -> None:
    assert ring.authenticate("Bearer sk-team-a-0123456789") == ring.keys[0]
    assert ring.authenticate("Bearer sk-team-b-abcdefghij").name == "team-b"
    assert ring.authenticate("bearer   sk-team-b-abcdefghij  ").name == "team-b"  # scheme case, spaces


@pytest.mark.parametrize(("header", "message"), [
    (None, "missing API key"),
    ("", "missing API key"),
    ("Basic c2stdGVhbS1hLTAxMjM0NTY3ODk=", "malformed"),
    ("sk-team-a-0123456789", "malformed"),  # the key without a scheme
    ("Bearer ", "malformed"),
    ("Bearer sk-team-a-012345678", "invalid API key"),  # a prefix of a real key
    ("Bearer sk-team-a-0123456789x", "invalid API key"),
    ("Bearer sk-team-c-0123456789", "invalid API key"),
])
def test_bad_authorization_is_refused(ring: KeyRing, header: str | None, message: str) -> None:
    with pytest.raises(AuthError, match=message):
        ring.authenticate(header)


def test_no_file_means_keys_off() -> None:
    ring = load_keys(None, classes=CLASSES)
    assert not ring.enabled
    assert ring.authenticate(None) is None
    assert ring.authenticate("Bearer anything-at-all") is None


@pytest.mark.parametrize("second", [
    {**TEAM_B, "name": "team-a"},  # same name
    {**TEAM_B, "key": TEAM_A["key"]},  # same key under another name
])
def test_duplicates_are_rejected(tmp_path: Path, second: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match="must be unique"):
        load_keys(key_file(tmp_path, TEAM_A, second), classes=CLASSES)


def test_default_class_must_be_a_class(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"API key 'team-a': default class 'batch' is not one of"):
        load_keys(key_file(tmp_path, {**TEAM_A, "defaultClass": "batch"}), classes=CLASSES)


def test_burst_without_rate_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="burst needs ratePerS"):
        load_keys(key_file(tmp_path, {**TEAM_B, "burst": 3}), classes=CLASSES)


@pytest.mark.parametrize(("fields", "where"), [
    ({"key": "short"}, "keys.0.key"),
    ({"name": "has space"}, "keys.0.name"),
    ({"ratePerS": 0}, "keys.0.ratePerS"),
    ({"ratePerS": 1, "burst": -2}, "keys.0.burst"),
    ({"rate": 5}, "keys.0.rate"),  # unknown fields are refused, not ignored
])
def test_invalid_fields_name_the_file_and_field(tmp_path: Path, fields: dict[str, Any], where: str) -> None:
    path = key_file(tmp_path, {**TEAM_B, **fields})
    with pytest.raises(ValueError, match=rf"API keys file .*keys\.json: \[{where}\]"):
        load_keys(path, classes=CLASSES)


def test_unreadable_and_non_json_files(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="cannot read API keys file"):
        load_keys(tmp_path / "absent.json", classes=CLASSES)
    path = tmp_path / "keys.json"
    path.write_text("keys: []")
    with pytest.raises(ValueError, match="not JSON"):
        load_keys(path, classes=CLASSES)


@pytest.mark.parametrize(("fields", "size"), [
    ({"ratePerS": 5}, 5.0),  # no burst: one second's worth
    ({"ratePerS": 0.2}, 1.0),  # ... but at least one request
    ({"ratePerS": 0.2, "burst": 4}, 4.0),
])
def test_bucket_size(fields: dict[str, Any], size: float) -> None:
    assert ApiKey.model_validate({**TEAM_B, **fields}).bucket_size == size


def test_burst_below_one_is_rejected() -> None:
    # A bucket that can never hold a whole token refuses every request of the key forever (take_token
    # refills to at most `burst` and needs 1.0), answering 429 with a Retry-After that never comes true.
    with pytest.raises(ValueError, match="burst"):
        ApiKey.model_validate({**TEAM_B, "ratePerS": 5, "burst": 0.5})


def test_an_empty_key_list_is_an_error_not_auth_off(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="lists no keys"):
        load_keys(key_file(tmp_path), classes=["chat"])
