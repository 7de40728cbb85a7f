"""Shutdown while a handler is mid-way: kopf runs its cleanup (which closes the operator's client) without
waiting for timers, so a reconcile may issue its next request on a closed client. It must stop quietly
(no traceback, no half-written status), and a re-login must not be mistaken for a shutdown."""

from __future__ import annotations

import logging
from typing import Any

import kmock
import kopf
import pytest
import yaml

from adaserve.operator import handlers
from adaserve.operator.config import OperatorConfig
from adaserve.operator.kube import Closed, Kube
from tests.operator.cluster import Cluster
from tests.operator.schema import EXAMPLE_PATH

pytestmark = pytest.mark.asyncio


def info(url: str) -> kopf.ConnectionInfo:
    return kopf.ConnectionInfo(server=url, insecure=True)


async def test_closed_client_refuses_requests_but_relogin_does_not_close() -> None:
    async with Cluster() as cluster, kmock.Server(cluster):
        kube = Kube()
        await kube.login(info(str(cluster.url)))
        assert await kube.get("v1", "ConfigMap", "default", "absent") is None
        await kube.login(info(str(cluster.url)))  # kopf logs in again when credentials are refused
        assert await kube.get("v1", "ConfigMap", "default", "absent") is None
        await kube.close()
        with pytest.raises(Closed):
            await kube.get("v1", "ConfigMap", "default", "absent")


async def test_reconcile_on_a_closed_client_stops_without_error(caplog: pytest.LogCaptureFixture) -> None:
    async with Cluster() as cluster, kmock.Server(cluster):
        memo = kopf.Memo()
        handlers.configure(kopf.OperatorSettings(), memo, OperatorConfig(resync_s=1.0, redis_timeout_s=0.5))
        await memo.kube.login(info(str(cluster.url)))
        await memo.kube.close()
        body: dict[str, Any] = yaml.safe_load(EXAMPLE_PATH.read_text())
        body["metadata"].update(namespace="serving", uid="u-1", generation=1)
        patch = kopf.Patch()
        with caplog.at_level(logging.DEBUG):
            await handlers.reconcile(kopf.Body(body), patch, memo, logging.getLogger("test"))
        assert not patch, "a stopped reconcile writes no status"
        assert "operator stopping" in caplog.text
