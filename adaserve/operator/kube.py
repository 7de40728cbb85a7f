"""The operator's Kubernetes access: get, create, merge-patch and delete namespaced objects, and ``apply`` (create,
or patch what drifted) over the maintained client, kubernetes_asyncio.

kopf has no public CRUD API. The transport is kubernetes_asyncio's ApiClient (the official client's async port:
TLS, certificates, tokens, pooling), given kopf's login result (``kopf.ConnectionInfo``: server, CA, token or
client certificate), so the operator authenticates once, the same way for kopf and for itself, in a pod
(service account) or outside (kubeconfig). Objects stay JSON dicts end to end (``call_api`` with the "object"
response type), never the client's models: the drift check compares what the operator renders with what the
API server holds, server defaults included, and a model round trip would drop or reshape fields. The typed
per-kind APIs would need one method name per kind; the paths of ``PLURALS`` serve all of them. The library's
DynamicClient is not used: in 36.1 it reads responses unloaded, a path on which >= 400 raises nothing, so a 404
came back as a Status "resource".

Why not server-side apply: the merge patch plus ``removals`` gives the same end state for the fields the
operator owns, and kmock's emulator, which the operator's tests run against, applies every PATCH as a merge
(no field managers), so a server-side apply could not be tested there.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import kopf
from kubernetes_asyncio.client import ApiClient, Configuration
from kubernetes_asyncio.client.exceptions import ApiException

from adaserve.operator import names

log = logging.getLogger(__name__)
# The client logs every response body at DEBUG, and kopf's --verbose turns DEBUG on: that would put the Redis
# password Secret the operator reads (rbac.readSecrets) into the log. Its request lines stay at DEBUG elsewhere.
logging.getLogger("kubernetes_asyncio.client.rest").setLevel(logging.INFO)

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
STRICT = [("fieldValidation", "Strict")]
CLOSE_GRACE_S = 5  # on shutdown, requests still in flight (an orphaned timer's) may finish first


class Closed(Exception):
    """The operator is shutting down: the client takes no new requests (handlers stop quietly on this)."""


class ApiError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status
        self.message = message


def _message(error: ApiException) -> str:
    """The API server's own message (a Status object's), else the HTTP reason."""
    try:
        status = json.loads(error.body or "")
    except (TypeError, ValueError):
        status = None
    message = status.get("message") if isinstance(status, dict) else None
    return str(message or error.reason or "no message")


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
    """The maintained client (kubernetes_asyncio's ApiClient) made from the credentials of the last login.

    ApiClient does the transport: TLS and its CA, client certificates, the bearer token, connection pooling,
    JSON, and an ApiException for every answer >= 400. Here: which credentials (kopf's), the shutdown rules
    below, and the few verbs the operator needs, resource-agnostic through the API paths of ``PLURALS``.
    """

    def __init__(self) -> None:
        self._info: kopf.ConnectionInfo | None = None
        self._api: ApiClient | None = None
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        self._inflight = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._closed = False

    async def login(self, info: kopf.ConnectionInfo) -> None:
        """New credentials (kopf logs in again when the old ones are refused): a new client next time."""
        self._info = info
        await self._drop_client()

    async def close(self) -> None:
        """For good (operator shutdown): refuse new requests at once, let those in flight finish, then close.

        kopf runs its cleanup without waiting for timers, so a reconcile may be between two requests; its
        next one raises ``Closed`` instead of failing on a closed connector.
        """
        self._closed = True
        await self._drop_client()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    async def _drop_client(self) -> None:
        # detach first: a request issued while we wait opens a fresh client (or raises Closed), never
        # picks up the one about to close
        api, self._api = self._api, None
        if api is None:
            return
        if self._inflight:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._idle.wait(), CLOSE_GRACE_S)
        await api.close()

    def _open(self) -> ApiClient:
        if self._closed:
            raise Closed("the operator is shutting down")
        if self._api is not None:
            return self._api
        info = self._info
        if info is None:
            raise RuntimeError("not logged in yet")
        api = ApiClient(self._configuration(info))
        api.user_agent = "adaserve-operator"
        if not info.token and info.username and info.password:  # basic auth: ApiClient knows bearer tokens only
            basic = base64.b64encode(f"{info.username}:{info.password}".encode()).decode()
            api.set_default_header("Authorization", f"Basic {basic}")
        self._api = api
        return api

    def _configuration(self, info: kopf.ConnectionInfo) -> Configuration:
        """kopf's login result (in a pod: the service account; outside: the kubeconfig) as the client's config."""
        cfg = Configuration(host=info.server.rstrip("/"))
        cfg.client_side_validation = False  # objects pass through as JSON, never as models
        if info.token:
            cfg.api_key = {"BearerToken": info.token}
            cfg.api_key_prefix = {"BearerToken": info.scheme or "Bearer"}
        cfg.verify_ssl = not info.insecure
        cfg.ssl_ca_cert = info.ca_path or self._file("ca.crt", info.ca_data)
        cfg.cert_file = info.certificate_path or self._file("client.crt", info.certificate_data)
        cfg.key_file = info.private_key_path or self._file("client.key", info.private_key_data)
        return cfg

    def _file(self, name: str, data: bytes | str | None) -> str | None:
        """Base64 credentials (a kubeconfig's *-data fields) as a file: the client reads certificates from files."""
        if not data:
            return None
        self._tmp = self._tmp or tempfile.TemporaryDirectory(prefix="adaserve-kube-")
        path = Path(self._tmp.name, name)
        path.write_bytes(base64.b64decode(data))
        return str(path)

    async def _request(self, method: str, url: str, *, body: Any = None, query: list[tuple[str, str]] | None = None,
                       content_type: str = "application/json") -> dict[str, Any]:
        api = self._open()
        self._inflight += 1
        self._idle.clear()
        try:
            data = await api.call_api(
                url, method, query_params=query or [], body=body, auth_settings=["BearerToken"],
                header_params={"Accept": "application/json", "Content-Type": content_type},
                response_types_map={200: "object", 201: "object", 202: "object"}, _return_http_data_only=True,
                _request_timeout=REQUEST_TIMEOUT_S)
        except ApiException as e:
            raise ApiError(e.status, _message(e)) from None
        finally:
            self._inflight -= 1
            if not self._inflight:
                self._idle.set()
        return data if isinstance(data, dict) else {}

    async def get(self, api_version: str, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            return await self._request("GET", path(api_version, kind, namespace, name))
        except ApiError as e:
            if e.status == 404:
                return None
            raise

    async def create(self, obj: Mapping[str, Any]) -> dict[str, Any]:
        meta = obj["metadata"]
        return await self._request("POST", path(obj["apiVersion"], obj["kind"], meta["namespace"]), body=obj,
                                   query=STRICT)

    async def patch(self, obj: Mapping[str, Any], changes: Mapping[str, Any]) -> dict[str, Any]:
        """A JSON merge patch: maps merge, lists and scalars are replaced, null removes."""
        meta = obj["metadata"]
        return await self._request("PATCH", path(obj["apiVersion"], obj["kind"], meta["namespace"], meta["name"]),
                                   body=changes, query=STRICT, content_type="application/merge-patch+json")

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

