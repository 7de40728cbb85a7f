"""The engine's switches read at each call (adaserve.engine.environment): what ``os.environ.get`` gives, every way a
caller sets the environment, without the exception ``os.environ.get`` raises inside for an unset variable."""

from __future__ import annotations

import os
from unittest import mock

import pytest

from adaserve.engine.environment import env
from adaserve.engine.speculation import draft_steps
from tests.engine.helpers import exceptions_raised_in

NAME = "ADASERVE_TEST_ENVIRONMENT_SWITCH"


def test_env_is_os_environ_get_every_way_the_environment_is_set(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(NAME, raising=False)
    assert env(NAME) is None
    monkeypatch.setenv(NAME, "on")
    assert env(NAME) == "on"
    monkeypatch.setenv(NAME, "")
    assert env(NAME) == "" == os.environ.get(NAME)
    monkeypatch.setenv(NAME, "é")  # not ASCII: decoded as os.environ decodes it
    assert env(NAME) == "é" == os.environ.get(NAME)
    monkeypatch.delenv(NAME)
    with mock.patch.dict(os.environ, {NAME: "OFF"}):
        assert env(NAME) == "OFF"
    assert env(NAME) is None  # the patch undone
    os.environ[NAME] = "x"
    try:
        assert env(NAME) == "x"
    finally:
        del os.environ[NAME]
    assert env(NAME) is None


def test_an_unset_switch_is_read_without_an_exception_inside(monkeypatch: pytest.MonkeyPatch) -> None:
    """``os.environ.get`` raises and catches a KeyError for an unset variable: cheap in a warm loop, ~17 us a call
    right after a forward (issue 30). ``env``, and the switches read through it, raise nothing."""
    monkeypatch.delenv(NAME, raising=False)
    assert exceptions_raised_in(lambda: os.environ.get(NAME))[0] != []  # what env avoids
    assert exceptions_raised_in(lambda: env(NAME)) == ([], None)
    monkeypatch.delenv(draft_steps.ENV, raising=False)
    assert exceptions_raised_in(draft_steps.enabled) == ([], True)
    for value, on in (("off", False), ("OFF", False), ("0", False), ("on", True), ("", True)):
        monkeypatch.setenv(draft_steps.ENV, value)
        assert draft_steps.enabled() is on
