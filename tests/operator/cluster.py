"""The operator under test, for real: kopf's own runner against kmock's Kubernetes emulator.

kmock's KubernetesEmulator stores objects as plain JSON: it has no controllers, no garbage collector, and
it does not stamp server-side metadata. ``Cluster`` adds the little the operator and kopf rely on:
uid, creationTimestamp, a resourceVersion that changes on every write (kopf's JSON patches test it),
a generation that changes with the spec, 422 for a failed patch test (as the API server answers, so kopf
retries on its next cycle instead of backing off on a 500), a watch that continues a list without repeating
or losing an event, and counts of writes per object.
"""

from __future__ import annotations

import asyncio
import collections
import datetime
import itertools
import threading
import time
import uuid
import warnings
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import aiohttp
import jsonpatch
import kmock
import kopf
import yaml

from adaserve.operator import handlers
from adaserve.operator.config import OperatorConfig

T = TypeVar("T")
CR_RESOURCE = "adaserve.io/v1alpha1/adaservedeployments"


class Cluster(kmock.KubernetesEmulator):
    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        with warnings.catch_warnings():  # kmock 0.8 reads its bundled file with a deprecated importlib call
            warnings.simplefilter("ignore", DeprecationWarning)
            self.resources.load_bundled()  # a real cluster's built-in kinds (kopf needs namespaces, events, CRDs)
        self.resources[CR_RESOURCE] = kmock.ResourceInfo(
            kind="AdaServeDeployment", singular="adaservedeployment", namespaced=True, shortnames={"asd"},
            verbs={"get", "list", "watch", "create", "update", "patch", "delete"}, subresources={"status", "scale"})
        for plural, kind, namespaced in (("clusterkopfpeerings", "ClusterKopfPeering", False),
                                         ("kopfpeerings", "KopfPeering", True)):  # crds/kopf.dev_peerings.yaml
            self.resources[f"kopf.dev/v1/{plural}"] = kmock.ResourceInfo(
                kind=kind, singular=plural[:-1], namespaced=namespaced,
                verbs={"get", "list", "watch", "create", "update", "patch", "delete"})
        self.versions = itertools.count(1)
        # (plural, name) -> how many creations / writes of any kind (merge or JSON patch, status included)
        self.creates: collections.Counter[tuple[str, str]] = collections.Counter()
        self.writes: collections.Counter[tuple[str, str]] = collections.Counter()
        # a list's resourceVersion -> (its resource, its moment in the change stream), until a watch from it
        self.listed: dict[str, tuple[Any, kmock.BusMark[Any]]] = {}

    # kmock 0.8's list and watch, made to behave as the API server's do where kopf depends on it. kmock's
    # watch replays every object that exists, then subscribes to the changes: kopf, which lists first,
    # sees each object twice (its first patch, a finalizer, then fails its resourceVersion test on the
    # stale copy, and kopf waits for an event that never comes), and a write between the replay and the
    # subscription is never streamed at all. Here a list marks its moment in the change stream and names
    # it in its resourceVersion; a watch from that version streams exactly what changed since. Any other
    # watch subscribes first and then replays, in one locked step (every write takes that lock too).
    # (The _KubernetesEmulator__ names are kmock's private helpers.)

    async def _serve_list(self, request: kmock.Request) -> Any:
        assert request.resource is not None
        if not any(r == request.resource for r in self._get_resources()):
            raise kmock.KubernetesResourceNotFoundError()
        bus = self._buses[request.resource]
        async with self._lock:
            mark = await bus.mark()
            items = [o.raw for o in self._KubernetesEmulator__get_objs(request, strict=False) if not o.deleted]
        for token, (resource, old) in list(self.listed.items()):  # one pending list per kind is enough
            if resource == request.resource:
                del self.listed[token]
                await bus.unmark(old)
        token = f"list-{next(self.versions)}"
        self.listed[token] = (request.resource, mark)
        return {"metadata": {"resourceVersion": token}, "items": items}

    async def _serve_watch(self, request: kmock.Request) -> AsyncIterator[Any]:
        yield b""  # the headers go out at once, as kmock's own watch does
        assert request.resource is not None
        bus = self._buses[request.resource]
        listed = self.listed.pop(request.params.get("resourceVersion", ""), None)
        if listed is not None and listed[0] == request.resource:
            mark, existing = listed[1], []
        else:
            if listed is not None:  # another kind's list: not this watch's
                await self._buses[listed[0]].unmark(listed[1])
            async with self._lock:
                mark = await bus.mark()
                existing = [{"type": "ADDED", "object": o.raw}
                            for o in self._KubernetesEmulator__get_objs(request, strict=False) if not o.deleted]
        try:
            for event in existing:
                yield event
            async for event in bus.stream(since=mark):
                meta = event.get("object", {}).get("metadata", {})
                if self._KubernetesEmulator__check(request, request.resource, meta.get("namespace"), meta.get("name"),
                                                   strict=False):
                    yield event
        finally:
            await bus.unmark(mark)

    async def _handle(self, request: kmock.Request) -> Any:
        if request.resource is not None and request.action in (kmock.action.CREATE, kmock.action.UPDATE):
            refusal = self._refusal(request)
            if refusal:
                raise kmock.KubernetesError(status=422, reason="Invalid", message=refusal)
            self._stamp(request)
        try:
            return await super()._handle(request)
        except jsonpatch.JsonPatchTestFailed as e:
            raise kmock.KubernetesError(status=422, reason="Invalid", message=str(e)) from None

    def _refusal(self, request: kmock.Request) -> str | None:
        """One of the API server's own validation rules, which kmock does not apply: a Deployment whose pod
        affinity requires nodes with no node selector term is refused with the API server's message."""
        if request.resource is None or request.resource.plural != "deployments" or not isinstance(request.data, dict):
            return None
        affinity = ((((request.data.get("spec") or {}).get("template") or {}).get("spec") or {}).get("affinity")
                    or {})
        required = (affinity.get("nodeAffinity") or {}).get("requiredDuringSchedulingIgnoredDuringExecution")
        if isinstance(required, dict) and not required.get("nodeSelectorTerms"):
            name = (request.data.get("metadata") or {}).get("name") or request.name
            return (f'Deployment.apps "{name}" is invalid: spec.template.spec.affinity.nodeAffinity.'
                    "requiredDuringSchedulingIgnoredDuringExecution.nodeSelectorTerms: Required value: must have at "
                    "least one node selector term")
        return None

    def _stamp(self, request: kmock.Request) -> None:
        plural = request.resource.plural if request.resource else ""
        version = str(next(self.versions))
        if request.action == kmock.action.CREATE and isinstance(request.data, dict):
            meta = request.data.setdefault("metadata", {})
            meta.update(uid=str(uuid.uuid4()), resourceVersion=version, generation=1,
                        creationTimestamp=datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"))
            self.creates[plural, meta.get("name", "")] += 1
            return
        self.writes[plural, request.name or ""] += 1
        if isinstance(request.data, list):  # a JSON patch: kopf's finalizers and annotations
            request.data.append({"op": "add", "path": "/metadata/resourceVersion", "value": version})
        elif isinstance(request.data, dict):  # a merge patch
            meta = request.data.setdefault("metadata", {})
            meta["resourceVersion"] = version
            if "spec" in request.data and not request.subresource:
                current = self.objects[request.resource, request.namespace, request.name]
                meta["generation"] = int(current.get("metadata", {}).get("generation", 1)) + 1


class Api:
    """The test's own client (plain aiohttp, not the operator's): what a user with kubectl would do."""

    def __init__(self, session: aiohttp.ClientSession) -> None:
        self.session = session

    async def call(self, method: str, path: str, body: Any = None, *, merge: bool = False) -> tuple[int, Any]:
        headers = {"Content-Type": "application/merge-patch+json"} if merge else {}
        async with self.session.request(method, path, json=body, headers=headers) as resp:
            return resp.status, await resp.json(content_type=None)

    async def get(self, path: str) -> dict[str, Any] | None:
        status, data = await self.call("GET", path)
        return data if status == 200 else None

    async def create(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        status, data = await self.call("POST", path, body)
        assert status in (200, 201), data
        return dict(data)

    async def patch(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        status, data = await self.call("PATCH", path, body, merge=True)
        assert status == 200, data
        return dict(data)

    async def delete(self, path: str) -> int:
        status, _ = await self.call("DELETE", path)
        return status


class Operator:
    """kopf.operator() in a thread of its own, as in production: its own event loop.

    Not in the test's loop: on exit kopf cancels every task started while it ran, which in a shared loop
    includes the emulator's handlers of the test's own connections.
    """

    def __init__(self, config: OperatorConfig) -> None:
        self.config = config
        self.stop = threading.Event()
        self.ready = threading.Event()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="kopf-under-test", daemon=True)

    def _run(self) -> None:
        registry = kopf.OperatorRegistry()
        handlers.register(registry, self.config)
        try:
            asyncio.run(kopf.operator(
                registry=registry, settings=kopf.OperatorSettings(), memo=kopf.Memo(), clusterwide=True,
                standalone=True, stop_flag=self.stop, ready_flag=self.ready))
        except BaseException as e:
            self.error = e
            self.ready.set()

    async def __aenter__(self) -> Operator:
        self.thread.start()
        await asyncio.to_thread(self.ready.wait, 30)
        if self.error is not None:
            raise self.error
        return self

    async def __aexit__(self, *_: object) -> None:
        self.stop.set()
        await asyncio.to_thread(self.thread.join, 30)  # off the test's loop: the emulator must keep serving
        assert not self.thread.is_alive(), "the operator did not stop"
        if self.error is not None:
            raise self.error


async def eventually(probe: Callable[[], Awaitable[T]], *, timeout: float = 30, what: str = "") -> T:
    """Poll until ``probe`` returns something truthy without raising; generous, for a busy 2-core machine."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while True:
        try:
            last = await probe()
            if last:
                return last
        except (AssertionError, KeyError, TypeError) as e:
            last = e
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what or probe}: last {last!r}")
        await asyncio.sleep(0.2)


def write_kubeconfig(path: Path, url: str) -> Path:
    """A kubeconfig for the emulator at ``url``: the operator logs in as it would outside a cluster."""
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "kmock",
        "clusters": [{"name": "kmock", "cluster": {"server": url}}],
        "users": [{"name": "test", "user": {}}],
        "contexts": [{"name": "kmock", "context": {"cluster": "kmock", "user": "test"}}]}))
    return path
