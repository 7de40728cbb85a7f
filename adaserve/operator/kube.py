"""A small async Kubernetes client: get, create, merge-patch and delete namespaced objects.

kopf has no public CRUD API, and the usual clients bring their own config loading and heavy models. This
one reuses kopf's login result (``kopf.ConnectionInfo``: server, CA, token or client certificate), so
the operator authenticates once, the same way for kopf and for itself, in a pod (service account) or
outside (kubeconfig), and it speaks plain HTTP+JSON that kmock's emulator serves in the tests.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import logging
import ssl
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import aiohttp
import kopf

from adaserve.operator import names

log = logging.getLogger(__name__)

# kind -> plural, for the kinds the operator touches (the RBAC in docs/k8s-contract.md grants exactly these)
PLURALS = {
    ("apps/v1", "Deployment"): "deployments",
    ("v1", "Service"): "services",
    ("v1", "ConfigMap"): "configmaps",
    ("policy/v1", "PodDisruptionBudget"): "poddisruptionbudgets",
    (names.API_VERSION, names.KIND): names.PLURAL,
    ("v1", "Secret"): "secrets",  # read only, and only with OperatorConfig.read_secrets: the Redis password
}
# Maps of a pod template the operator renders whole from the spec: a key the spec no longer has must leave the
# live object too, which a merge patch only does when told (key: null). kubectl's own annotations stay
# (`kubectl rollout restart` writes kubectl.kubernetes.io/restartedAt).
WHOLE_MAPS = (("spec", "template", "spec", "nodeSelector"), ("spec", "template", "spec", "affinity"),
              ("spec", "template", "metadata", "labels"), ("spec", "template", "metadata", "annotations"))
KEPT_PREFIXES = ("kubectl.kubernetes.io/",)
REQUEST_TIMEOUT_S = 30
# Writes refuse unknown fields (400) instead of dropping them with a warning: a typo inside a pod override's
# affinity or volume, which the CRD passes on unchecked, then shows in the status instead of vanishing.
STRICT = "?fieldValidation=Strict"
CLOSE_GRACE_S = 5  # on shutdown, requests still in flight (an orphaned timer's) may finish first


class Closed(Exception):
    """The operator is shutting down: the client takes no new requests (handlers stop quietly on this)."""


class ApiError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status
        self.message = message


def path(api_version: str, kind: str, namespace: str, name: str | None = None) -> str:
    plural = PLURALS[(api_version, kind)]
    base = f"/api/{api_version}" if "/" not in api_version else f"/apis/{api_version}"
    return f"{base}/namespaces/{namespace}/{plural}" + (f"/{name}" if name else "")


def is_subset(desired: Any, live: Any) -> bool:
    """Whether the live object already has everything desired (the server adds defaults; they do not count).

    Empty desired values match absent ones: the API server drops empty lists and maps.
    """
    if isinstance(desired, Mapping):
        if not isinstance(live, Mapping):
            return False
        return all(is_subset(v, live.get(k)) if k in live else v in ({}, [], None) for k, v in desired.items())
    if isinstance(desired, list):
        if live is None:
            return not desired
        return isinstance(live, list) and len(desired) == len(live) and all(map(is_subset, desired, live))
    return bool(desired == live)


def removals(desired: Mapping[str, Any], live: Mapping[str, Any]) -> dict[str, Any]:
    """The merge-patch nulls that drop what the live object has and ``desired`` no longer does, in WHOLE_MAPS."""
    out: dict[str, Any] = {}
    for where in WHOLE_MAPS:
        want, have = _at(desired, where), _at(live, where)
        if isinstance(want, Mapping) and isinstance(have, Mapping):
            stale = _stale(want, have)
            if stale:
                node = out
                for key in where[:-1]:
                    node = node.setdefault(key, {})
                node[where[-1]] = stale
    return out


def _at(obj: Any, where: tuple[str, ...]) -> Any:
    for key in where:
        obj = obj.get(key) if isinstance(obj, Mapping) else None
    return obj


def _stale(want: Mapping[str, Any], have: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in have.items():
        if key not in want:
            if not key.startswith(KEPT_PREFIXES):
                out[key] = None
        elif isinstance(want[key], Mapping) and isinstance(value, Mapping):
            deeper = _stale(want[key], value)
            if deeper:
                out[key] = deeper
    return out


def _merged(base: Mapping[str, Any], extra: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in extra.items():
        out[key] = _merged(out[key], value) if isinstance(out.get(key), Mapping) and isinstance(value, Mapping) \
            else value
    return out


def owned_by(obj: Mapping[str, Any], uid: str | None) -> bool:
    """Whether ``obj`` has an ownerReference to the object with ``uid`` (controller or not)."""
    return uid is not None and any(
        r.get("uid") == uid for r in (obj.get("metadata") or {}).get("ownerReferences") or [])


class Kube:
    """Holds the credentials of the last login and one HTTP session made from them."""

    def __init__(self) -> None:
        self._info: kopf.ConnectionInfo | None = None
        self._session: aiohttp.ClientSession | None = None
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        self._inflight = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._closed = False

    async def login(self, info: kopf.ConnectionInfo) -> None:
        """New credentials (kopf logs in again when the old ones are refused): a new session next time."""
        self._info = info
        await self._drop_session()

    async def close(self) -> None:
        """For good (operator shutdown): refuse new requests at once, let those in flight finish, then close.

        kopf runs its cleanup without waiting for timers, so a reconcile may be between two requests; its
        next one raises ``Closed`` instead of failing on a closed connector.
        """
        self._closed = True
        await self._drop_session()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    async def _drop_session(self) -> None:
        # detach first: a request issued while we wait opens a fresh session (or raises Closed), never
        # picks up the one about to close
        session, self._session = self._session, None
        if session is None:
            return
        if self._inflight:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._idle.wait(), CLOSE_GRACE_S)
        await session.close()

    def _open(self) -> aiohttp.ClientSession:
        if self._closed:
            raise Closed("the operator is shutting down")
        if self._session is not None:
            return self._session
        info = self._info
        if info is None:
            raise RuntimeError("not logged in yet")
        headers = {"User-Agent": "adaserve-operator"}
        auth = None
        if info.token:
            headers["Authorization"] = f"{info.scheme or 'Bearer'} {info.token}"
        elif info.username and info.password:
            auth = aiohttp.BasicAuth(info.username, info.password)
        connector = aiohttp.TCPConnector(ssl=self._ssl(info), limit=16)
        self._session = aiohttp.ClientSession(
            base_url=info.server.rstrip("/") + "/", headers=headers, auth=auth, connector=connector,
            timeout=aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S))
        return self._session

    def _ssl(self, info: kopf.ConnectionInfo) -> ssl.SSLContext | bool:
        if not info.server.startswith("https"):
            return False
        if info.insecure:
            return False
        ca_data = base64.b64decode(info.ca_data).decode() if info.ca_data else None
        ctx = ssl.create_default_context(cafile=info.ca_path, cadata=ca_data)
        if info.certificate_path or info.certificate_data:
            cert, key = info.certificate_path, info.private_key_path
            if info.certificate_data or info.private_key_data:
                # ssl loads client certificates from files only
                self._tmp = self._tmp or tempfile.TemporaryDirectory(prefix="adaserve-kube-")
                if info.certificate_data:
                    cert = str(Path(self._tmp.name, "client.crt"))
                    Path(cert).write_bytes(base64.b64decode(info.certificate_data))
                if info.private_key_data:
                    key = str(Path(self._tmp.name, "client.key"))
                    Path(key).write_bytes(base64.b64decode(info.private_key_data))
            if cert:
                ctx.load_cert_chain(cert, key)
        return ctx

    async def _request(self, method: str, url: str, *, body: Any = None,
                       content_type: str = "application/json") -> dict[str, Any]:
        session = self._open()
        kwargs: dict[str, Any] = {}
        if body is not None:
            kwargs["json"] = body
            kwargs["headers"] = {"Content-Type": content_type}
        self._inflight += 1
        self._idle.clear()
        try:
            async with session.request(method, url.lstrip("/"), **kwargs) as resp:
                data = await resp.json(content_type=None) if resp.content_length != 0 else {}
                if resp.status >= 400:
                    message = data.get("message") if isinstance(data, dict) else None
                    raise ApiError(resp.status, str(message or resp.reason))
                return data if isinstance(data, dict) else {}
        finally:
            self._inflight -= 1
            if not self._inflight:
                self._idle.set()

    async def get(self, api_version: str, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            return await self._request("GET", path(api_version, kind, namespace, name))
        except ApiError as e:
            if e.status == 404:
                return None
            raise

    async def create(self, obj: Mapping[str, Any]) -> dict[str, Any]:
        meta = obj["metadata"]
        return await self._request("POST", path(obj["apiVersion"], obj["kind"], meta["namespace"]) + STRICT, body=obj)

    async def patch(self, obj: Mapping[str, Any], changes: Mapping[str, Any]) -> dict[str, Any]:
        """A JSON merge patch: maps merge, lists and scalars are replaced, null removes."""
        meta = obj["metadata"]
        return await self._request("PATCH", path(obj["apiVersion"], obj["kind"], meta["namespace"], meta["name"]) +
                                   STRICT, body=changes, content_type="application/merge-patch+json")

    async def delete(self, api_version: str, kind: str, namespace: str, name: str) -> bool:
        """False if it was already gone."""
        try:
            await self._request("DELETE", path(api_version, kind, namespace, name),
                                body={"kind": "DeleteOptions", "apiVersion": "v1", "propagationPolicy": "Background"})
        except ApiError as e:
            if e.status == 404:
                return False
            raise
        return True

    async def apply(self, obj: Mapping[str, Any], *, owner_uid: str | None = None) -> tuple[dict[str, Any], str]:
        """Create the object, or patch it where it differs from ``obj``; returns (live object, what was done).

        Idempotent: an object that already matches is left alone (no write, no new resourceVersion), so a
        restart or a repeated timer makes no duplicates and no churn. A create that loses a race with
        another writer (409) turns into a patch. With ``owner_uid``, an existing object without an
        ownerReference to that uid is someone else's: it is left untouched and reported as "conflict".
        """
        meta = obj["metadata"]
        live = await self.get(obj["apiVersion"], obj["kind"], meta["namespace"], meta["name"])
        if live is None:
            try:
                return await self.create(obj), "created"
            except ApiError as e:
                if e.status != 409:
                    raise
                live = await self.get(obj["apiVersion"], obj["kind"], meta["namespace"], meta["name"]) or {}
        if owner_uid is not None and not owned_by(live, owner_uid):
            return live, "conflict"
        stale = removals(obj, live)
        if is_subset(obj, live) and not stale:
            return live, "unchanged"
        changes = _merged({k: v for k, v in obj.items() if k not in ("apiVersion", "kind")}, stale)
        return await self.patch(obj, changes), "patched"

