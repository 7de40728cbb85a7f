"""The operator as deployed: ``python -m adaserve.operator`` in its own process (kopf's CLI, the handlers
module, peering ``adaserve``, the liveness endpoint), against the emulator, logging in by kubeconfig."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import aiohttp
import kmock
import pytest
import yaml

from adaserve.server_process import free_port
from tests.operator.cluster import Api, Cluster, eventually, write_kubeconfig
from tests.operator.schema import EXAMPLE_PATH, ROOT


@pytest.mark.asyncio
async def test_python_m_adaserve_operator(tmp_path: Path) -> None:
    async with Cluster() as cluster, kmock.Server(cluster):
        url = str(cluster.url).rstrip("/")
        kubeconfig = write_kubeconfig(tmp_path / "kubeconfig", url)
        port = free_port()
        env = {**os.environ, "KUBECONFIG": str(kubeconfig), "ADASERVE_OPERATOR_RESYNC_S": "1"}
        async with aiohttp.ClientSession(base_url=url) as session:
            api = Api(session)
            # the peering object the chart creates (kopf refuses to start with --peering and none)
            peering = {"apiVersion": "kopf.dev/v1", "kind": "ClusterKopfPeering", "metadata": {"name": "adaserve"}}
            await api.create("/apis/kopf.dev/v1/clusterkopfpeerings", peering)
            body = yaml.safe_load(EXAMPLE_PATH.read_text())
            body["spec"]["redis"] = {"url": "redis://127.0.0.1:6379/0"}
            await api.create("/apis/adaserve.io/v1alpha1/namespaces/serving/adaservedeployments", body)

            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "adaserve.operator", f"--liveness=http://127.0.0.1:{port}/healthz", "--verbose",
                cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE)
            try:
                worker = "/apis/apps/v1/namespaces/serving/deployments/llama-worker"
                await eventually(lambda: api.get(worker), timeout=60, what="worker Deployment from the subprocess")

                async def alive() -> bool:
                    async with aiohttp.ClientSession() as probe, probe.get(f"http://127.0.0.1:{port}/healthz") as r:
                        return r.status == 200

                await eventually(alive, timeout=30, what="liveness endpoint")

                async def peered() -> dict[str, object]:
                    peering = await api.get("/apis/kopf.dev/v1/clusterkopfpeerings/adaserve")
                    return dict((peering or {}).get("status") or {})

                assert len(await eventually(peered, what="the operator's entry in the peering")) == 1
            finally:
                proc.terminate()
                _, stderr = await asyncio.wait_for(proc.communicate(), timeout=30)
            assert b"Traceback" not in stderr, stderr.decode()[-3000:]
