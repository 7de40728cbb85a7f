"""kopf handlers, kept thin: parse the spec, render the children, adopt them, apply them, report a status.

Run: ``python -m kopf run --all-namespaces --peering=adaserve -m adaserve.operator.handlers``
(or ``python -m adaserve.operator``, which adds the liveness endpoint and a priority).

Decisions, and why:

- Apply is idempotent (create, or merge-patch what differs; see kube.Kube.apply): create, update and
  resume (an operator restart) run the same code, and a restart creates no duplicates.
- Drift and hand-deleted children: a child's DELETED event re-applies its owner at once, and the resync
  timer re-applies every child every ``ADASERVE_OPERATOR_RESYNC_S`` seconds, so edits by hand are undone.
  The timer's first run waits one interval (create or resume has just reconciled). A switch from the
  managed Redis to an external one deletes the managed Redis Deployment and Service; create, update and
  resume check for that, the timer does not (a switch is a spec change, so an update always sees it).
- Deletion: the children carry ownerReferences, so Kubernetes' garbage collector removes them. The
  resync timer makes kopf put a finalizer (``adaserve.io/operator``) on the resource (it must stop the
  timer before the resource goes), so a deletion handler runs anyway; it deletes the children
  explicitly, which is what removes them where there is no garbage collector (kmock's emulator in the
  tests). Without the operator running, a deletion waits for it; to delete regardless, remove the
  finalizer: ``kubectl patch asd NAME --type=merge -p '{"metadata":{"finalizers":null}}'``.
- An invalid spec (CEL is missing on old clusters, and the emulator validates nothing) sets phase
  Failed with condition Degraded/InvalidSpec and a Warning event, and the handler returns normally: a
  retry cannot fix a spec, only a new spec can (which arrives as an update). So does a child the API server
  refuses as invalid (400/422): the pod override passes some Kubernetes objects on unchecked (an affinity, a
  volume's source), and the API server is the one that knows them; the message is the API server's.
- A child's name held by an object this resource does not own (no ownerReference with its uid) is
  never taken over: someone else's ConfigMap or Deployment is left as it is, the other children are
  still applied, and the status says Degraded/NameConflict (plus one Warning event) until the name is
  free again; the resync then creates the child.
- Redis that cannot be read sets the Degraded condition (RedisUnreachable, with the host and the
  error), cleared by the next read that works (status.py says when it counts).
- Leader election is kopf's peering: ``--peering=adaserve`` needs a ClusterKopfPeering named
  ``adaserve`` (a KopfPeering per namespace when run with ``--namespace``; CRDs in
  crds/kopf.dev_peerings.yaml). Operators of equal priority all pause, so replicas need distinct
  ``--priority`` values (``python -m adaserve.operator`` draws one).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import datetime
import logging
from collections.abc import Mapping
from typing import Any

import kopf

from adaserve.operator import builders, names, status
from adaserve.operator.config import OperatorConfig
from adaserve.operator.kube import PLURALS, ApiError, Closed, Kube, owned_by
from adaserve.operator.registrations import WorkersRead, read_workers
from adaserve.operator.spec import DeploymentSpec, SpecError, parse_spec
from adaserve.redis_client import RedisAuth, where

CR = (names.GROUP, names.VERSION, names.PLURAL)
CHILDREN = tuple((api_version, plural) for (api_version, kind), plural in PLURALS.items()
                 if kind not in (names.KIND, "Secret"))
OURS = {"app.kubernetes.io/managed-by": names.MANAGED_BY}
FINALIZER = "adaserve.io/operator"
log = logging.getLogger(__name__)  # not kopf's per-object logger: that one also posts events


def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, config: OperatorConfig) -> None:
    # kopf's state in annotations of our own prefix: the structural schema would prune status.kopf
    settings.persistence.finalizer = FINALIZER
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="adaserve.io")
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix="adaserve.io", key="last-handled-configuration")
    settings.posting.level = logging.WARNING  # events for problems only, not for every handler run
    memo.config = config
    memo.setdefault("kube", Kube())
    memo.locks = {}


async def login(memo: kopf.Memo, **kwargs: Any) -> kopf.ConnectionInfo | None:
    """kopf's own fallbacks (in a pod, else the kubeconfig), shared with the operator's client."""
    info = kopf.login_with_service_account(**kwargs) or kopf.login_with_kubeconfig(**kwargs)
    if info is not None:
        await memo.setdefault("kube", Kube()).login(info)
    return info


async def cleanup(memo: kopf.Memo, **_: Any) -> None:
    kube = memo.get("kube")
    if kube is not None:
        await kube.close()


async def reconcile(body: kopf.Body, patch: kopf.Patch, memo: kopf.Memo, logger: kopf.Logger,
                    stopped: kopf.DaemonStopped | None = None, prune: bool = True, **_: Any) -> None:
    """create / update / resume (and, through ``resync``, the timer): children as the spec says, status as
    they are.

    ``prune``: also remove the optional children the spec no longer asks for (a managed Redis after a switch to
    an external one, a dropped disruptionBudget's PodDisruptionBudget). Only create, update and resume do (a
    switch is a spec change, which one of them always sees), not every resync.
    ``stopped`` (timers only) turns true when the operator exits or the resource goes: then stop between
    two requests instead of running on against a closing client. The client may close first (kopf's
    cleanup does not wait for timers): then stop the same way; the next start resumes.
    """
    try:
        new = await sync(body, memo=memo, logger=logger, stopped=stopped, prune=prune)
    except Closed:
        log.debug("operator stopping: reconcile of %s left for the next start", body["metadata"]["name"])
        return
    if new is not None:
        patch.status.update(status_changes(new, body.get("status") or {}))


async def resync(body: kopf.Body, patch: kopf.Patch, memo: kopf.Memo, logger: kopf.Logger,
                 stopped: kopf.DaemonStopped, **_: Any) -> None:
    """The resync timer: reconcile (drift repair, a fresh status) without the Redis cleanup."""
    await reconcile(body, patch, memo, logger, stopped=stopped, prune=False)


async def delete_children(body: kopf.Body, memo: kopf.Memo, logger: kopf.Logger, **_: Any) -> None:
    meta = body["metadata"]
    for api_version, kind, child in _child_names(meta["name"]):
        await _delete_owned(memo.kube, api_version, kind, meta["namespace"], child, meta.get("uid"), logger)
    memo.locks.pop((meta["namespace"], meta["name"]), None)


async def _delete_owned(kube: Kube, api_version: str, kind: str, namespace: str, name: str, uid: str | None,
                        logger: kopf.Logger) -> None:
    """Delete the object if it exists and ``uid`` owns it (someone else's object of that name stays)."""
    live = await kube.get(api_version, kind, namespace, name)
    if live is not None and owned_by(live, uid) and await kube.delete(api_version, kind, namespace, name):
        logger.info(f"deleted {kind} {name}")


async def child_event(event: Mapping[str, Any], body: kopf.Body, memo: kopf.Memo, logger: kopf.Logger,
                      **_: Any) -> None:
    """A child deleted by hand comes back at once (the timer would bring it back later anyway)."""
    if event.get("type") != "DELETED":
        return
    owner = next((r for r in body["metadata"].get("ownerReferences") or []
                  if r.get("apiVersion") == names.API_VERSION and r.get("kind") == names.KIND), None)
    if owner is None:
        return
    namespace = body["metadata"]["namespace"]
    with contextlib.suppress(Closed):  # shutting down: the next start's resume re-applies it
        parent = await memo.kube.get(names.API_VERSION, names.KIND, namespace, owner["name"])
        if parent is None or parent["metadata"].get("deletionTimestamp"):
            return  # the owner is going away: this deletion is the garbage collector's or ours
        logger.info(f"{body.get('kind')} {body['metadata']['name']} was deleted; re-applying {owner['name']}")
        await sync(kopf.Body(parent), memo=memo, logger=logger)


async def sync(body: kopf.Body, *, memo: kopf.Memo, logger: kopf.Logger,
               stopped: kopf.DaemonStopped | None = None, prune: bool = False) -> dict[str, Any] | None:
    """Apply the children of one resource and return its new status (the one function all paths share).

    None if ``stopped`` turned true on the way. With ``prune``, also delete the optional children the spec no
    longer asks for (``_optional_children``).
    """
    kube: Kube = memo.kube
    config: OperatorConfig = memo.config
    meta = body["metadata"]
    name, namespace = meta["name"], meta["namespace"]
    previous = (body.get("status") or {}).get("conditions") or []
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    lock = memo.locks.setdefault((namespace, name), asyncio.Lock())  # the timer and an update may overlap
    async with lock:
        try:
            spec = parse_spec(body.get("spec"))
        except SpecError as e:
            return await _invalid(body, kube, str(e), previous=previous, now=now)

        manifests = builders.children(spec, name=name, namespace=namespace)
        # controller ref without blockOwnerDeletion: setting that needs RBAC on the owner's finalizers
        kopf.append_owner_reference(manifests, owner=body, block_owner_deletion=False)
        applied = await _apply_all(kube, manifests, uid=meta.get("uid"), logger=logger, stopped=stopped)
        if applied is None:
            return None
        live, conflicts, refused = applied
        if refused:  # what the spec passes on unchecked (an affinity, a volume's source) and the API server refused
            return await _invalid(body, kube, "; ".join(refused), previous=previous, now=now)
        _warn_conflicts(body, conflicts, previous)
        if prune:  # children the spec no longer asks for: a managed Redis after a switch, a dropped budget
            for api_version, kind, child in _optional_children(spec, name):
                await _delete_owned(kube, api_version, kind, namespace, child, meta.get("uid"), logger)

    if stopped:
        return None
    url = builders.redis_url(spec, name=name, namespace=namespace)
    auth = await _redis_auth(kube, spec, namespace, url, read_secrets=config.read_secrets)
    if isinstance(auth, WorkersRead):  # nothing to read with (a Secret that may not or cannot be read)
        read = auth
    else:
        read = await read_workers(url, names.redis_prefix(namespace, name), timeout_s=config.redis_timeout_s,
                                  auth=auth)
    observed = status.Observed(
        worker=live.get(f"Deployment/{names.child(name, names.WORKER)}"),
        gateway=live.get(f"Deployment/{names.child(name, names.GATEWAY)}"),
        redis=live.get(f"Deployment/{names.child(name, names.REDIS)}"),
        workers=read.workers,
        redis_error=read.error,
        conflicts=tuple(conflicts),
    )
    return status.compute(spec, name=name, namespace=namespace, generation=meta.get("generation"),
                          observed=observed, previous=previous, now=now)


async def _invalid(body: kopf.Body, kube: Kube, error: str, *, previous: list[Mapping[str, Any]],
                   now: str) -> dict[str, Any]:
    """The status of a resource whose spec cannot be served as it is (phase Failed, Degraded/InvalidSpec), with
    one Warning event per distinct error, not one per resync."""
    meta = body["metadata"]
    name, namespace = meta["name"], meta["namespace"]
    reported = next((c.get("message") for c in previous if c.get("type") == status.DEGRADED), None)
    if reported != error:
        log.warning("%s/%s: invalid spec: %s", namespace, name, error)
        kopf.warn(body, reason="InvalidSpec", message=error)
    worker = await kube.get("apps/v1", "Deployment", namespace, names.child(name, names.WORKER))
    return status.compute(None, name=name, namespace=namespace, generation=meta.get("generation"),
                          observed=status.Observed(worker=worker), error=error, previous=previous, now=now)


Applied = tuple[dict[str, dict[str, Any]], list[str], list[str]]


async def _redis_auth(kube: Kube, spec: DeploymentSpec, namespace: str, url: str, *,
                      read_secrets: bool) -> RedisAuth | WorkersRead:
    """The credentials to read the registrations with, from the Secrets the spec names; or, when they may not
    (``read_secrets`` off: no status.workers, and no Degraded for it) or cannot be read, the read's outcome."""
    rd = spec.redis
    ca = rd.tls.ca_secret if rd.tls is not None else None
    if rd.password_secret is None and ca is None:
        return RedisAuth()
    if not read_secrets:
        return WorkersRead(None)
    values: list[str | None] = []
    for ref in (rd.password_secret, ca):
        if ref is None:
            values.append(None)
            continue
        try:
            secret = await kube.get("v1", "Secret", namespace, ref.name)
        except ApiError as e:
            secret, why = None, str(e)
        else:
            why = "not found"
        data = ((secret or {}).get("data") or {}).get(ref.key)
        if data is None:
            key = f"key {ref.key} of " if secret is not None else ""
            return WorkersRead(None, f"Redis at {where(url)}: cannot read {key}Secret {namespace}/{ref.name}: "
                                     f"{why if secret is None else 'no such key'}")
        values.append(base64.b64decode(data).decode())
    return RedisAuth(password=values[0], username=rd.username, ca_data=values[1])


async def _apply_all(kube: Kube, manifests: list[dict[str, Any]], *, uid: str | None, logger: kopf.Logger,
                     stopped: kopf.DaemonStopped | None) -> Applied | None:
    """Apply each child; returns ({"Kind/name": live}, ["Kind/name" held by someone else], ["Kind/name: why" the
    API server refused as invalid]), None if stopped.

    A foreign object is neither patched nor counted as ours (its status would pass for our rollout). A refused
    child (400/422: a pod field the spec passes on unchecked, such as an affinity, is wrong) does not stop the
    others; a retry cannot fix it, only a new spec can.
    """
    live: dict[str, dict[str, Any]] = {}
    conflicts: list[str] = []
    refused: list[str] = []
    for manifest in manifests:
        if stopped:
            return None
        key = f"{manifest['kind']}/{manifest['metadata']['name']}"
        try:
            obj, done = await kube.apply(manifest, owner_uid=uid)
        except ApiError as e:
            if e.status not in (400, 422):
                raise
            refused.append(f"{key}: the API server refused it: {e.message}")
            continue
        if done == "conflict":
            conflicts.append(key)
            continue
        live[key] = obj
        if done != "unchanged":
            logger.info(f"{done} {manifest['kind']} {manifest['metadata']['name']}")
    return live, conflicts, refused


def _warn_conflicts(body: kopf.Body, conflicts: list[str], previous: list[Mapping[str, Any]]) -> None:
    """One Warning event per newly taken name, not one per resync (the condition stays meanwhile)."""
    reported = next((c.get("message") or "" for c in previous
                     if c.get("type") == status.DEGRADED and c.get("reason") == status.NAME_CONFLICT), "")
    new = [c for c in conflicts if c not in reported]
    if new:
        message = f"{', '.join(new)}: not owned by this AdaServeDeployment; left untouched"
        log.warning("%s/%s: %s", body["metadata"]["namespace"], body["metadata"]["name"], message)
        kopf.warn(body, reason=status.NAME_CONFLICT, message=message)


def status_changes(new: Mapping[str, Any], old: Mapping[str, Any]) -> dict[str, Any]:
    """Only what differs, so an unchanged status costs no write (and no watch event)."""
    return {k: v for k, v in new.items() if old.get(k) != v and not (v is None and k not in old)}


def _child_names(name: str) -> list[tuple[str, str, str]]:
    return [
        ("apps/v1", "Deployment", names.child(name, names.GATEWAY)),
        ("v1", "Service", names.child(name, names.GATEWAY)),
        ("policy/v1", "PodDisruptionBudget", names.child(name, names.WORKER)),
        ("apps/v1", "Deployment", names.child(name, names.WORKER)),
        ("v1", "Service", names.child(name, names.WORKER)),
        ("apps/v1", "Deployment", names.child(name, names.REDIS)),
        ("v1", "Service", names.child(name, names.REDIS)),
        ("v1", "ConfigMap", names.slo_configmap(name)),
    ]


def _optional_children(spec: DeploymentSpec, name: str) -> list[tuple[str, str, str]]:
    """The children only some specs have, which ``spec`` does not: to delete where they are left over."""
    out = []
    if not spec.redis.managed:
        out += [("apps/v1", "Deployment", names.child(name, names.REDIS)),
                ("v1", "Service", names.child(name, names.REDIS))]
    if spec.disruption_budget is None:
        out.append(("policy/v1", "PodDisruptionBudget", names.child(name, names.WORKER)))
    return out


def register(registry: kopf.OperatorRegistry, config: OperatorConfig) -> None:
    """Every handler into ``registry`` (tests use a fresh one with a short resync)."""

    def startup(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
        configure(settings, memo, config)

    kopf.on.startup(registry=registry)(startup)
    kopf.on.login(registry=registry)(login)
    kopf.on.cleanup(registry=registry)(cleanup)
    for on in (kopf.on.create, kopf.on.update, kopf.on.resume):
        on(*CR, registry=registry, id="reconcile")(reconcile)
    # kopf runs a timer as soon as it spawns it: the first resync waits its interval (create or resume
    # has just reconciled)
    kopf.timer(*CR, registry=registry, interval=config.resync_s, initial_delay=config.resync_s,
               id="resync")(resync)
    kopf.on.delete(*CR, registry=registry, id="delete-children")(delete_children)
    for api_version, plural in CHILDREN:
        kopf.on.event(api_version, plural, labels=OURS, registry=registry, id="child-event")(child_event)


register(kopf.get_default_registry(), OperatorConfig.from_env())
