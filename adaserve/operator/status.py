"""Pure status: what the child Deployments and the workers' registrations say -> the resource's status.

Phases: Failed (the spec is invalid), Degraded (a child's name is taken by an object this resource does
not own, or a Deployment reports a failed rollout: ProgressDeadlineExceeded, ReplicaFailure), Pending (a
child does not exist yet), Ready (every rollout is complete and every replica ready), else Progressing.
A worker loads and profiles for minutes before it is ready, so "not ready yet" is Progressing, never
Degraded. ``readyWorkers`` is the kubelet's view (the /readyz probe); ``workers`` is the workers' own view
from Redis, and empty when Redis cannot be read.

A Redis the operator cannot read sets the Degraded condition (RedisUnreachable) but not the phase nor
Ready: only the operator's view is known to be missing, the pods may well reach it (an external URL only
they resolve), and ``kubectl wait --for=condition=Ready`` must not flap with a Redis blip.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any

from adaserve.contract.registration import Registration
from adaserve.operator import names
from adaserve.operator.spec import DeploymentSpec

READY, PROGRESSING, DEGRADED = "Ready", "Progressing", "Degraded"
NAME_CONFLICT, REDIS_UNREACHABLE = "NameConflict", "RedisUnreachable"


@dataclasses.dataclass(frozen=True)
class Observed:
    """The live children (None: absent, or not ours) and the workers' registrations (None: not readable).

    ``redis_error`` says why the registrations could not be read; ``conflicts`` names the children
    (``ConfigMap/llama-slo-classes``) whose names objects this resource does not own already hold.
    """

    worker: Mapping[str, Any] | None = None
    gateway: Mapping[str, Any] | None = None
    redis: Mapping[str, Any] | None = None
    workers: list[dict[str, Any]] | None = None
    redis_error: str | None = None
    conflicts: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class Rollout:
    ready: int
    done: bool
    failure: str | None  # "Reason: message" of a failed rollout


def rollout(deployment: Mapping[str, Any], desired: int) -> Rollout:
    """Like ``kubectl rollout status``: the newest ReplicaSet has every replica, available, and no old pods."""
    st = deployment.get("status") or {}
    generation = (deployment.get("metadata") or {}).get("generation")
    observed = st.get("observedGeneration")
    current = generation is None or (observed is not None and observed >= generation)
    ready = int(st.get("readyReplicas") or 0)
    updated = int(st.get("updatedReplicas") or 0)
    total = int(st.get("replicas") or 0)
    available = int(st.get("availableReplicas") or 0)
    done = current and updated >= desired and total <= updated and available >= desired and ready >= desired
    failure = None
    for c in st.get("conditions") or []:
        failed_progress = c.get("type") == "Progressing" and c.get("status") == "False"
        failed_replicas = c.get("type") == "ReplicaFailure" and c.get("status") == "True"
        if failed_progress or failed_replicas:
            failure = f"{c.get('reason') or c.get('type')}: {c.get('message') or 'no message'}"
    return Rollout(ready=ready, done=done, failure=failure)


def worker_entries(registrations: Iterable[Registration]) -> list[dict[str, Any]]:
    """The workers' registrations (adaserve/contract/registration.py) -> status.workers entries, sorted by id."""
    out = [{"id": r.worker_id, "address": r.address, "device": r.device or "", "budget": r.budget, "status": r.status}
           for r in registrations]
    return sorted(out, key=lambda w: w["id"])


def compute(spec: DeploymentSpec | None, *, name: str, namespace: str, generation: int | None,
            observed: Observed, error: str | None = None,
            previous: Iterable[Mapping[str, Any]] = (), now: str) -> dict[str, Any]:
    """The whole status (keys with None are removed by the merge patch).

    ``spec`` None with ``error`` set means the spec is invalid; ``previous`` conditions keep their
    lastTransitionTime while their status does not change.
    """
    worker = rollout(observed.worker, spec.replicas if spec else 0) if observed.worker else None
    status: dict[str, Any] = {
        "observedGeneration": generation,
        "replicas": int(((observed.worker or {}).get("status") or {}).get("replicas") or 0),
        "readyWorkers": worker.ready if worker else 0,
        "workers": observed.workers or [],
        "gatewayUrl": names.gateway_url(namespace, name, spec.gateway.port) if spec else None,
        # for the scale subresource (an HPA needs the pods it scales)
        "selector": ",".join(f"{k}={v}" for k, v in names.selector(name, names.WORKER).items()),
    }
    if spec is None:
        phase, why = "Failed", ("InvalidSpec", error or "invalid spec")
        redis_problem = None
    else:
        phase, why = _phase(spec, observed)
        redis_problem = _redis_problem(spec, observed)
    status["phase"] = phase
    status["conditions"] = _conditions(phase, why, redis_problem, previous=previous, now=now)
    return status


def _redis_problem(spec: DeploymentSpec, observed: Observed) -> str | None:
    """Why the registrations cannot be read, once that is a problem.

    A managed Redis is unreachable while its pod starts, which is normal: only once its rollout is done.
    """
    if observed.redis_error is None:
        return None
    if spec.redis.managed and not (observed.redis is not None and rollout(observed.redis, 1).done):
        return None
    return f"cannot read worker registrations from {observed.redis_error}"


def _phase(spec: DeploymentSpec, observed: Observed) -> tuple[str, tuple[str, str]]:
    """The phase, and the (reason, message) that explains it."""
    if observed.conflicts:  # first: a child we may not touch also explains a missing or failed one
        taken = ", ".join(observed.conflicts)
        return "Degraded", (NAME_CONFLICT, f"{taken}: the name is taken by an object this AdaServeDeployment "
                                           "does not own; the operator leaves it alone (delete or rename it)")
    wanted: list[tuple[str, Mapping[str, Any] | None, int]] = [
        ("workers", observed.worker, spec.replicas),
        ("gateway", observed.gateway, spec.gateway.replicas),
    ]
    if spec.redis.managed:
        wanted.append(("redis", observed.redis, 1))
    missing = [what for what, d, _ in wanted if d is None]
    if missing:
        return "Pending", ("Creating", f"waiting for {', '.join(missing)} to be created")
    rollouts = [(what, rollout(d, n), n) for what, d, n in wanted if d is not None]
    failures = [f"{what}: {r.failure}" for what, r, _ in rollouts if r.failure]
    counts = "; ".join(f"{what} {r.ready}/{n} ready" for what, r, n in rollouts)
    if failures:
        return "Degraded", ("RolloutFailed", "; ".join(failures))
    if all(r.done for _, r, _ in rollouts):
        return "Ready", ("AllReady", counts)
    return "Progressing", ("RollingOut", counts)


def _conditions(phase: str, why: tuple[str, str], redis_problem: str | None, *,
                previous: Iterable[Mapping[str, Any]], now: str) -> list[dict[str, Any]]:
    reason, message = why
    settled = {"Ready": "Complete", "Degraded": reason, "Failed": reason}
    states = {
        READY: (phase == "Ready", reason, message),
        PROGRESSING: (phase in ("Pending", "Progressing"), settled.get(phase, reason), message),
        DEGRADED: _degraded(phase, why, redis_problem),
    }
    before = {c.get("type"): c for c in previous}
    out = []
    for kind, (true, why_reason, why_message) in states.items():
        value = "True" if true else "False"
        old = before.get(kind) or {}
        since = old.get("lastTransitionTime") if old.get("status") == value and old.get("lastTransitionTime") else now
        out.append({"type": kind, "status": value, "reason": why_reason, "message": why_message,
                    "lastTransitionTime": since})
    return out


def _degraded(phase: str, why: tuple[str, str], redis_problem: str | None) -> tuple[bool, str, str]:
    """The Degraded condition: the phase's failure first, an unreadable Redis after it (or alone)."""
    reason, message = why
    if phase in ("Degraded", "Failed"):
        return True, reason, f"{message}; {redis_problem}" if redis_problem else message
    if redis_problem:
        return True, REDIS_UNREACHABLE, redis_problem
    return False, "AsExpected", message
