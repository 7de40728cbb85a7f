"""The operator end to end: kopf's real runner against kmock's Kubernetes emulator (tests/operator/cluster.py).

Each test has its own emulator, operator and namespace (the namespace also isolates its Redis keys).
The resync timer runs every second here, so repairs and status refreshes show up within a few seconds;
every wait polls with a generous deadline rather than sleeping a fixed time.
"""

from __future__ import annotations

import asyncio
import base64
import copy
import dataclasses
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import kmock
import pytest
import pytest_asyncio
import redis.asyncio as aioredis
import yaml

from adaserve.operator import builders, names
from adaserve.operator.config import OperatorConfig
from adaserve.operator.kube import is_subset, owned_by
from adaserve.operator.spec import MSG_DRAFT_OR_DRAFTS, MSG_REDIS_ONE, MSG_TENSOR_PARALLEL, parse_spec
from tests.operator.cluster import Api, Cluster, Operator, eventually, write_kubeconfig
from tests.operator.schema import EXAMPLE_PATH, FULL_POD
from tests.private_redis import PrivateRedis

pytestmark = pytest.mark.asyncio

REDIS_URL = "redis://127.0.0.1:6379/0"
CONFIG = OperatorConfig(resync_s=1.0, redis_timeout_s=0.5)
NAME = "llama"
CHILDREN = [("api/v1", "configmaps", "llama-slo-classes"),
            ("apis/apps/v1", "deployments", "llama-worker"), ("api/v1", "services", "llama-worker"),
            ("apis/apps/v1", "deployments", "llama-gateway"), ("api/v1", "services", "llama-gateway")]


class Env:
    def __init__(self, cluster: Cluster, api: Api, namespace: str) -> None:
        self.cluster, self.api, self.ns = cluster, api, namespace

    def path(self, prefix: str, plural: str, name: str | None = None) -> str:
        return f"/{prefix}/namespaces/{self.ns}/{plural}" + (f"/{name}" if name else "")

    @property
    def cr(self) -> str:
        return self.path("apis/adaserve.io/v1alpha1", "adaservedeployments", NAME)

    def resource(self, **spec: Any) -> dict[str, Any]:
        """The example, in this test's namespace, with the local Redis (a managed one would not resolve here)."""
        body = yaml.safe_load(EXAMPLE_PATH.read_text())
        body["metadata"]["namespace"] = self.ns
        body["spec"]["redis"] = {"url": REDIS_URL}
        body["spec"].update(copy.deepcopy(spec))
        return dict(body)

    async def create(self, body: dict[str, Any]) -> dict[str, Any]:
        return await self.api.create(self.path("apis/adaserve.io/v1alpha1", "adaservedeployments"), body)

    async def children(self) -> dict[str, dict[str, Any] | None]:
        return {f"{plural}/{name}": await self.api.get(self.path(prefix, plural, name))
                for prefix, plural, name in CHILDREN}

    async def status(self) -> dict[str, Any]:
        return dict(((await self.api.get(self.cr)) or {}).get("status") or {})


@pytest_asyncio.fixture
async def env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Env]:
    async with Cluster() as cluster, kmock.Server(cluster):
        url = str(cluster.url).rstrip("/")
        # the operator logs in as it would outside a cluster: kopf's kubeconfig login, shared with its client
        kubeconfig = write_kubeconfig(tmp_path / "kubeconfig", url)
        monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
        async with aiohttp.ClientSession(base_url=url) as session:
            e = Env(cluster, Api(session), f"t-{uuid.uuid4().hex[:8]}")
            yield e
            await _forget_redis(e.ns)


async def _forget_redis(namespace: str) -> None:
    r = aioredis.from_url(REDIS_URL)
    keys = [k async for k in r.scan_iter(f"{names.redis_prefix(namespace, NAME)}:*")]
    if keys:
        await r.delete(*keys)
    await r.aclose()


def expected_children(env: Env, body: dict[str, Any], uid: str) -> dict[str, dict[str, Any]]:
    spec = parse_spec(body["spec"])
    out = {}
    for child in builders.children(spec, name=NAME, namespace=env.ns):
        child["metadata"]["ownerReferences"] = [{
            "controller": True, "blockOwnerDeletion": False, "apiVersion": "adaserve.io/v1alpha1",
            "kind": "AdaServeDeployment", "name": NAME, "uid": uid}]
        plural = {"ConfigMap": "configmaps", "Deployment": "deployments", "Service": "services"}[child["kind"]]
        out[f"{plural}/{child['metadata']['name']}"] = child
    return out


async def test_create_makes_owned_children_and_a_status(env: Env) -> None:
    async with Operator(CONFIG):
        body = env.resource()
        cr = await env.create(body)
        want = expected_children(env, body, cr["metadata"]["uid"])

        async def all_there() -> dict[str, Any]:
            kids = await env.children()
            return kids if all(kids.values()) else {}

        kids = await eventually(all_there, what="children")
        assert sorted(kids) == sorted(want)
        for key, child in want.items():
            assert is_subset(child, kids[key]), key  # the exact rendering, ownerReference included
            assert kids[key]["metadata"]["ownerReferences"] == child["metadata"]["ownerReferences"]

        st = await eventually(lambda: _phase(env, "Progressing"), what="phase Progressing")
        assert st["observedGeneration"] == 1 and st["readyWorkers"] == 0 and st["workers"] == []
        assert st["gatewayUrl"] == f"http://llama-gateway.{env.ns}.svc:80"
        cr = await env.api.get(env.cr)
        assert cr is not None and cr["metadata"]["finalizers"] == ["adaserve.io/operator"]


async def _phase(env: Env, phase: str) -> dict[str, Any]:
    st = await env.status()
    return st if st.get("phase") == phase else {}


async def test_update_changes_replicas_and_classes(env: Env) -> None:
    async with Operator(CONFIG):
        await env.create(env.resource())
        worker = env.path("apis/apps/v1", "deployments", "llama-worker")
        await eventually(lambda: env.api.get(worker), what="worker Deployment")

        classes = [{"name": "chat", "tpotMs": 45}, {"name": "batch", "tpotMs": 300, "priority": -5, "sheddable": True}]
        await env.api.patch(env.cr, {"spec": {"replicas": 3, "sloClasses": classes, "defaultSloClass": "batch"}})

        async def updated() -> bool:
            d = await env.api.get(worker)
            cm = await env.api.get(env.path("api/v1", "configmaps", "llama-slo-classes"))
            assert d is not None and cm is not None
            e = {x["name"]: x.get("value") for x in d["spec"]["template"]["spec"]["containers"][0]["env"]}
            return (d["spec"]["replicas"] == 3 and e["ADASERVE_SLO_CLASSES"] == '{"chat": 45, "batch": 300}'
                    and e["ADASERVE_DEFAULT_SLO_CLASS"] == "batch"
                    and json.loads(cm["data"]["slo-classes.json"])[1]["name"] == "batch")

        await eventually(updated, what="worker and ConfigMap updated")
        st = await eventually(lambda: _generation(env, 2), what="observedGeneration 2")
        assert st["phase"] == "Progressing"


async def test_switching_to_an_external_redis_removes_the_managed_one(env: Env) -> None:
    managed = [env.path("apis/apps/v1", "deployments", "llama-redis"), env.path("api/v1", "services", "llama-redis")]

    async def redis_children(present: bool) -> bool:
        return all([(await env.api.get(p) is not None) == present for p in managed])

    async with Operator(CONFIG):
        await env.create(env.resource(redis={"managed": True}))
        await eventually(lambda: redis_children(True), what="the managed Redis Deployment and Service")
        await env.api.patch(env.cr, {"spec": {"redis": {"managed": None, "url": REDIS_URL}}})
        await eventually(lambda: redis_children(False), what="the managed Redis deleted after the switch")
        await eventually(lambda: _generation(env, 2), what="observedGeneration 2")
        assert await _all_children(env, present=True)  # the rest stays


async def _generation(env: Env, generation: int) -> dict[str, Any]:
    st = await env.status()
    return st if st.get("observedGeneration") == generation else {}


async def test_status_reports_ready_workers_and_their_registrations(env: Env) -> None:
    async with Operator(CONFIG):
        await env.create(env.resource())
        await eventually(lambda: _phase(env, "Progressing"), what="phase Progressing")
        # what the Deployment controller and the kubelet would report once the pods pass /readyz
        for name, n in (("llama-worker", 2), ("llama-gateway", 1)):
            path = env.path("apis/apps/v1", "deployments", name)
            d = await env.api.get(path)
            assert d is not None
            await env.api.call("PATCH", f"{path}/status", {"status": {
                "observedGeneration": d["metadata"]["generation"], "replicas": n, "updatedReplicas": n,
                "readyReplicas": n, "availableReplicas": n}}, merge=True)
        # what the workers write in Redis (adaserve/worker/registry.py)
        r = aioredis.from_url(REDIS_URL)
        prefix = names.redis_prefix(env.ns, NAME)
        for i in range(2):
            await r.set(f"{prefix}:workers:llama-worker-{i}", json.dumps({
                "worker_id": f"llama-worker-{i}", "address": f"http://10.0.0.{i}:8000", "status": "ready",
                "device": "NVIDIA H100 80GB HBM3", "budget": 256}), px=60_000)
            await r.zadd(f"{prefix}:workers", {f"llama-worker-{i}": int(time.time() * 1000) + 60_000})
        await r.aclose()

        st = await eventually(lambda: _phase(env, "Ready"), what="phase Ready")
        st = await eventually(lambda: _with_workers(env, 2), what="two workers in the status")
        assert st["readyWorkers"] == 2 and st["replicas"] == 2
        assert st["workers"][0] == {"id": "llama-worker-0", "address": "http://10.0.0.0:8000",
                                    "device": "NVIDIA H100 80GB HBM3", "budget": 256, "status": "ready"}
        assert {c["type"]: c["status"] for c in st["conditions"]} == {
            "Ready": "True", "Progressing": "False", "Degraded": "False"}


async def _with_workers(env: Env, n: int) -> dict[str, Any]:
    st = await env.status()
    return st if len(st.get("workers") or []) == n else {}


async def test_delete_removes_the_children(env: Env) -> None:
    async with Operator(CONFIG):
        await env.create(env.resource())
        await eventually(lambda: _all_children(env, present=True), what="children")
        assert await env.api.delete(env.cr) == 200
        await eventually(lambda: _all_children(env, present=False), what="children deleted")
        await eventually(lambda: _gone(env), what="resource gone (finalizer released)")


async def _all_children(env: Env, *, present: bool) -> bool:
    kids = await env.children()
    return all((v is not None) == present for v in kids.values())


async def _gone(env: Env) -> bool:
    return await env.api.get(env.cr) is None


async def test_hand_deleted_children_come_back_at_once(env: Env) -> None:
    # a resync far beyond the deadline: only the children's DELETED events can bring them back in time
    async with Operator(OperatorConfig(resync_s=600, redis_timeout_s=0.5)):
        await env.create(env.resource())
        worker = env.path("apis/apps/v1", "deployments", "llama-worker")
        cm = env.path("api/v1", "configmaps", "llama-slo-classes")
        first = await eventually(lambda: env.api.get(worker), what="worker Deployment")
        await eventually(lambda: env.api.get(cm), what="ConfigMap")

        assert await env.api.delete(worker) == 200
        assert await env.api.delete(cm) == 200
        again = await eventually(lambda: env.api.get(worker), what="worker Deployment recreated")
        await eventually(lambda: env.api.get(cm), what="ConfigMap recreated")
        assert again["metadata"]["uid"] != first["metadata"]["uid"]  # a new object, not the old one
        assert again["spec"] == first["spec"]


async def test_drift_is_undone_by_the_resync(env: Env) -> None:
    async with Operator(CONFIG):
        await env.create(env.resource())
        worker = env.path("apis/apps/v1", "deployments", "llama-worker")
        await eventually(lambda: env.api.get(worker), what="worker Deployment")
        await env.api.patch(worker, {"spec": {"replicas": 7}})  # someone scaled the child instead of the resource

        async def restored() -> bool:
            d = await env.api.get(worker)
            return d is not None and d["spec"]["replicas"] == 2

        await eventually(restored, what="replicas restored to the resource's 2")


async def test_invalid_spec_sets_a_condition_without_retrying_then_recovers(env: Env) -> None:
    async with Operator(CONFIG):
        await env.create(env.resource(redis={"managed": True, "url": REDIS_URL}))  # both: what CEL would refuse
        st = await eventually(lambda: _phase(env, "Failed"), what="phase Failed")
        degraded = next(c for c in st["conditions"] if c["type"] == "Degraded")
        assert degraded["status"] == "True" and degraded["reason"] == "InvalidSpec"
        assert degraded["message"] == f"spec.redis: {MSG_REDIS_ONE}"
        assert not any((await env.children()).values())  # nothing rendered

        await eventually(lambda: _warnings(env), what="a Warning event InvalidSpec")

        # no crash loop and no retries: nothing writes the resource again while nothing changes
        await _quiet(CONFIG.resync_s)  # the last kopf annotations settle
        writes = env.cluster.writes["adaservedeployments", NAME]
        settled = await env.api.get(env.cr)
        await _quiet(3 * CONFIG.resync_s)
        assert env.cluster.writes["adaservedeployments", NAME] == writes
        assert await env.api.get(env.cr) == settled
        assert [e["message"] for e in await _warnings(env)] == [f"spec.redis: {MSG_REDIS_ONE}"]  # said once

        await env.api.patch(env.cr, {"spec": {"redis": {"managed": None}}})  # fixed: the URL only
        await eventually(lambda: _phase(env, "Progressing"), what="phase Progressing after the fix")
        await eventually(lambda: _all_children(env, present=True), what="children after the fix")


async def _warnings(env: Env, reason: str = "InvalidSpec") -> list[dict[str, Any]]:
    events = await env.api.get(env.path("api/v1", "events")) or {}
    return [e for e in events.get("items", []) if e.get("reason") == reason]


async def _quiet(seconds: float) -> None:
    await asyncio.sleep(seconds)


async def test_restart_makes_no_duplicates_and_no_writes(env: Env) -> None:
    async with Operator(CONFIG):
        await env.create(env.resource())
        await eventually(lambda: _all_children(env, present=True), what="children")
        await eventually(lambda: _phase(env, "Progressing"), what="phase Progressing")
    creates = dict(env.cluster.creates)
    writes = {key: n for key, n in env.cluster.writes.items() if key[0] != "adaservedeployments"}
    assert all(creates[plural, name] == 1 for _, plural, name in CHILDREN)

    async with Operator(CONFIG):  # a new process: resume handlers and timers run on what exists
        await _quiet(3 * CONFIG.resync_s)
        assert dict(env.cluster.creates) == creates  # nothing created again
        assert {key: n for key, n in env.cluster.writes.items() if key[0] != "adaservedeployments"} == writes
        kids = await env.children()
        assert all(kids.values())


async def _degraded(env: Env, reason: str) -> dict[str, Any]:
    """The status once its Degraded condition has ``reason`` (True for a problem, False for AsExpected)."""
    st = await env.status()
    degraded = next((c for c in st.get("conditions") or [] if c["type"] == "Degraded"), {})
    return st if degraded.get("reason") == reason else {}


def _degraded_message(st: dict[str, Any]) -> str:
    return str(next(c for c in st["conditions"] if c["type"] == "Degraded")["message"])


async def test_unreadable_redis_is_reported_then_cleared(env: Env) -> None:
    async with Operator(CONFIG):
        body = env.resource()
        body["spec"]["redis"] = {"url": "redis://:s3cret@127.0.0.1:1/0"}  # nothing listens on port 1
        await env.create(body)
        st = await eventually(lambda: _degraded(env, "RedisUnreachable"), what="Degraded/RedisUnreachable")
        message = _degraded_message(st)
        assert message.startswith("cannot read worker registrations from Redis at 127.0.0.1:1: "), message
        assert "s3cret" not in message
        assert st["phase"] == "Progressing" and st["workers"] == []  # the rollout is not what failed

        await env.api.patch(env.cr, {"spec": {"redis": {"url": REDIS_URL}}})
        st = await eventually(lambda: _degraded(env, "AsExpected"), what="Degraded cleared")
        assert next(c for c in st["conditions"] if c["type"] == "Degraded")["status"] == "False"


async def test_a_foreign_object_holding_a_childs_name_is_left_alone(env: Env) -> None:
    cm = env.path("api/v1", "configmaps", "llama-slo-classes")
    foreign = await env.api.create(env.path("api/v1", "configmaps"), {
        "apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "llama-slo-classes", "namespace": env.ns},
        "data": {"slo-classes.json": "someone else's"}})
    async with Operator(CONFIG):
        cr = await env.create(env.resource())
        st = await eventually(lambda: _degraded(env, "NameConflict"), what="Degraded/NameConflict")
        assert st["phase"] == "Degraded" and "ConfigMap/llama-slo-classes" in _degraded_message(st)

        uid = cr["metadata"]["uid"]

        async def others_created() -> bool:
            kids = await env.children()
            del kids["configmaps/llama-slo-classes"]
            return all(v is not None and owned_by(v, uid) for v in kids.values())

        await eventually(others_created, what="the other children, owned")
        await _quiet(3 * CONFIG.resync_s)  # several resyncs: still no write to the foreign object
        assert await env.api.get(cm) == foreign
        assert env.cluster.writes["configmaps", "llama-slo-classes"] == 0
        assert len(await _warnings(env, "NameConflict")) == 1  # one event, not one per resync

        assert await env.api.delete(cm) == 200  # the name is free: the next resync creates our own

        async def ours() -> bool:
            got = await env.api.get(cm)
            return got is not None and owned_by(got, uid)

        await eventually(ours, what="our ConfigMap")
        await eventually(lambda: _phase(env, "Progressing"), what="phase Progressing once the name is free")


async def test_several_drafts_reach_the_worker_pods_and_a_bad_list_is_a_condition(env: Env) -> None:
    """model.drafts beside model.draft is refused (CEL would; the emulator does not) with the CRD's words in
    the status; once draft is removed, the worker Deployment gets every draft as ADASERVE_DRAFTS."""
    drafts = ["/models/llama-3.2-1b-instruct", "/models/llama-3.2-3b-instruct"]
    async with Operator(CONFIG):
        body = env.resource(speculation={"policy": "spin"})
        body["spec"]["model"]["drafts"] = drafts  # and the example's draft: both
        await env.create(body)
        st = await eventually(lambda: _phase(env, "Failed"), what="phase Failed")
        assert _degraded_message(st) == f"spec.model: {MSG_DRAFT_OR_DRAFTS}"
        assert not any((await env.children()).values())

        await env.api.patch(env.cr, {"spec": {"model": {"draft": None}}})

        async def worker_env() -> dict[str, str]:
            d = await env.api.get(env.path("apis/apps/v1", "deployments", f"{NAME}-worker"))
            if d is None:
                return {}
            return {e["name"]: e.get("value") for e in d["spec"]["template"]["spec"]["containers"][0]["env"]}

        got = await eventually(worker_env, what="the worker Deployment")
        assert json.loads(got["ADASERVE_DRAFTS"]) == drafts and "ADASERVE_DRAFT" not in got
        assert got["ADASERVE_POLICY"] == "spin"


async def test_a_tensor_parallel_worker_pod_gets_its_gpus_shared_memory_and_flag(env: Env) -> None:
    """tensorParallelSize 4 on the example's one GPU is refused in the status (CEL would; the emulator does not);
    with gpusPerWorker 4 the worker pod asks for 4 GPUs, mounts a memory-backed /dev/shm and runs
    --tensor-parallel-size 4; back to one rank, the flag and the volume go (the children are replaced whole)."""
    worker = env.path("apis/apps/v1", "deployments", f"{NAME}-worker")

    async def pod(ranks: int) -> dict[str, Any]:
        d = await env.api.get(worker)
        spec = (d or {}).get("spec", {}).get("template", {}).get("spec", {})
        flag = "--tensor-parallel-size" in spec.get("containers", [{}])[0].get("command", [])
        return spec if d is not None and flag == (ranks > 1) else {}

    async with Operator(CONFIG):
        body = env.resource()
        body["spec"]["resources"]["tensorParallelSize"] = 4
        await env.create(body)
        st = await eventually(lambda: _phase(env, "Failed"), what="phase Failed")
        assert _degraded_message(st) == f"spec.resources.tensorParallelSize: {MSG_TENSOR_PARALLEL}"
        assert not any((await env.children()).values())

        await env.api.patch(env.cr, {"spec": {"resources": {"gpusPerWorker": 4, "shmSize": "8Gi"}}})
        spec = await eventually(lambda: pod(4), what="the four-rank worker Deployment")
        container = spec["containers"][0]
        assert container["command"] == ["adaserve", "worker", "--tensor-parallel-size", "4"]
        assert container["resources"]["limits"]["nvidia.com/gpu"] == "4"
        assert container["resources"]["requests"]["nvidia.com/gpu"] == "4"
        assert {"name": "shm", "mountPath": "/dev/shm"} in container["volumeMounts"]
        assert {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": "8Gi"}} in spec["volumes"]
        assert {"name": "ADASERVE_DEVICE", "value": "cuda"} in container["env"]
        await eventually(lambda: _phase(env, "Progressing"), what="phase Progressing after the fix")

        # (shmSize kept would keep /dev/shm at one rank too: a size asked for is mounted whatever the ranks)
        await env.api.patch(env.cr, {"spec": {"resources": {"gpusPerWorker": 1, "tensorParallelSize": None,
                                                            "shmSize": None}}})
        spec = await eventually(lambda: pod(1), what="the one-rank worker Deployment")
        container = spec["containers"][0]
        assert container["command"] == ["adaserve", "worker"]
        assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"
        assert all(v["name"] != "shm" for v in spec["volumes"])
        assert all(m["name"] != "shm" for m in container["volumeMounts"])


async def test_a_pod_override_and_a_disruption_budget_reach_the_cluster_and_leave_it(env: Env) -> None:
    """With tolerations, nodeSelector and the rest set, the worker pods get them and a PodDisruptionBudget covers
    them; a nodeSelector key, a toleration and the budget dropped from the spec leave the live objects too."""
    worker = env.path("apis/apps/v1", "deployments", f"{NAME}-worker")
    pdb = env.path("apis/policy/v1", "poddisruptionbudgets", f"{NAME}-worker")

    async def pod(when: Any) -> dict[str, Any]:
        d = await env.api.get(worker)
        template = (d or {}).get("spec", {}).get("template", {})
        return template if d is not None and when(template) else {}

    async with Operator(CONFIG):
        body = env.resource(workerPod=FULL_POD, disruptionBudget={"maxUnavailable": 1})
        await env.create(body)
        template = await eventually(lambda: pod(lambda t: "tolerations" in t["spec"]), what="the worker Deployment")
        want = builders.worker_deployment(parse_spec(body["spec"]), name=NAME, namespace=env.ns)["spec"]["template"]
        assert is_subset(want, template)  # the exact rendering
        spec = template["spec"]
        assert spec["affinity"] == FULL_POD["affinity"] and spec["runtimeClassName"] == "nvidia"
        assert spec["nodeSelector"] == FULL_POD["nodeSelector"] and spec["tolerations"] == FULL_POD["tolerations"]
        assert spec["priorityClassName"] == "inference-high" and spec["imagePullSecrets"] == [{"name": "registry"}]
        assert template["metadata"]["labels"]["team"] == "search"
        container = spec["containers"][0]
        assert {"name": "NCCL_DEBUG", "value": "WARN"} in container["env"]
        assert {"name": "data", "mountPath": "/data", "readOnly": True} in container["volumeMounts"]
        budget = await eventually(lambda: env.api.get(pdb), what="the PodDisruptionBudget")
        assert budget["spec"] == {"maxUnavailable": 1, "selector": {"matchLabels": names.selector(NAME, names.WORKER)}}
        assert owned_by(budget, (await env.api.get(env.cr) or {})["metadata"]["uid"])

        # a merge patch of the resource, as kubectl edit sends: null drops a key of a map
        changed = {"nodeSelector": {"cloud.example.com/gpu-pool": None, "pool": "h200"},
                   "tolerations": FULL_POD["tolerations"][:1], "labels": {"team": None}, "affinity": None}
        await env.api.patch(env.cr, {"spec": {"workerPod": changed, "disruptionBudget": None}})
        template = await eventually(lambda: pod(lambda t: len(t["spec"].get("tolerations") or []) == 1),
                                    what="the worker Deployment with one toleration")
        assert template["spec"]["nodeSelector"] == {"pool": "h200"}  # the old key is gone from the pods too
        assert "affinity" not in template["spec"] and "team" not in template["metadata"]["labels"]

        async def no_budget() -> bool:
            return await env.api.get(pdb) is None

        await eventually(no_budget, what="the PodDisruptionBudget removed")


async def test_a_child_the_api_server_refuses_is_an_invalid_spec_condition(env: Env) -> None:
    """What the spec passes on unchecked (an affinity) and the API server refuses ends as phase Failed with the API
    server's own message, once, not as a handler crash retried forever; fixed, the worker Deployment appears."""
    bad = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": []}}}
    async with Operator(CONFIG):
        await env.create(env.resource(workerPod={"affinity": bad}))
        st = await eventually(lambda: _phase(env, "Failed"), what="phase Failed")
        message = _degraded_message(st)
        assert message.startswith(f"Deployment/{NAME}-worker: the API server refused it: "), message
        assert "must have at least one node selector term" in message
        assert next(c for c in st["conditions"] if c["type"] == "Degraded")["reason"] == "InvalidSpec"
        await eventually(lambda: _warnings(env), what="a Warning event InvalidSpec")
        kids = await env.children()
        assert kids[f"deployments/{NAME}-worker"] is None and kids[f"deployments/{NAME}-gateway"] is not None

        good = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
            {"matchExpressions": [{"key": "gpu", "operator": "In", "values": ["h100"]}]}]}}}
        await env.api.patch(env.cr, {"spec": {"workerPod": {"affinity": good}}})
        await eventually(lambda: _phase(env, "Progressing"), what="phase Progressing after the fix")
        worker = await env.api.get(env.path("apis/apps/v1", "deployments", f"{NAME}-worker"))
        assert worker is not None and worker["spec"]["template"]["spec"]["affinity"] == good
        assert len(await _warnings(env)) == 1


async def _register(url: str, password: str, prefix: str, worker_id: str) -> None:
    """What a worker writes in Redis (adaserve/worker/registry.py), into a Redis with a password."""
    r = aioredis.from_url(url, password=password)
    await r.set(f"{prefix}:workers:{worker_id}", json.dumps({
        "worker_id": worker_id, "address": "http://10.0.0.9:8000", "status": "ready", "device": "cpu",
        "budget": 32}), px=60_000)
    await r.zadd(f"{prefix}:workers", {worker_id: int(time.time() * 1000) + 60_000})
    await r.aclose()


async def test_status_reads_workers_from_a_redis_with_a_password_only_where_it_may_read_the_secret(
        env: Env, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """rbac.readSecrets (OperatorConfig.read_secrets): the operator reads the password Secret the resource names and
    lists the workers; without it, no status.workers and no Degraded for it; a Secret that is not there is said.
    The password shows in no log line, even at DEBUG (the client logs response bodies there)."""
    caplog.set_level(logging.DEBUG)
    locked = PrivateRedis(tmp_path, password="op-s3cret")
    try:
        await _register(locked.url, "op-s3cret", names.redis_prefix(env.ns, NAME), "llama-worker-a")
        body = env.resource(redis={"url": locked.url, "passwordSecret": {"name": "redis-auth"}})

        async with Operator(CONFIG):  # read_secrets off, the chart's default
            await env.create(body)
            st = await eventually(lambda: _phase(env, "Progressing"), what="phase Progressing")
            await _quiet(3 * CONFIG.resync_s)
            st = await env.status()
            assert st["workers"] == [] and next(
                c for c in st["conditions"] if c["type"] == "Degraded")["status"] == "False"

        async with Operator(dataclasses.replace(CONFIG, read_secrets=True)):
            st = await eventually(lambda: _degraded(env, "RedisUnreachable"), what="the missing Secret said")
            assert _degraded_message(st).endswith(f"cannot read Secret {env.ns}/redis-auth: not found"), st
            secret = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "redis-auth", "namespace": env.ns},
                      "data": {"password": base64.b64encode(b"op-s3cret").decode()}}
            await env.api.create(env.path("api/v1", "secrets"), secret)
            st = await eventually(lambda: _with_workers(env, 1), what="the worker read with the password")
            assert st["workers"][0]["id"] == "llama-worker-a"
            assert next(c for c in st["conditions"] if c["type"] == "Degraded")["status"] == "False"
            assert "op-s3cret" not in json.dumps(st)
        assert "op-s3cret" not in caplog.text and base64.b64encode(b"op-s3cret").decode() not in caplog.text
        assert any(r.levelno == logging.DEBUG for r in caplog.records)  # DEBUG was on while the Secret was read
    finally:
        locked.stop()
