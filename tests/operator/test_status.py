"""Pure status: phases and conditions from the children, worker details from registrations."""

from __future__ import annotations

from typing import Any

import pytest

from adaserve.contract.registration import parse_registration
from adaserve.operator import status
from adaserve.operator.handlers import status_changes
from adaserve.operator.spec import DeploymentSpec, parse_spec

NOW, LATER = "2026-01-01T00:00:00Z", "2026-01-01T00:05:00Z"
SELECTOR = "app.kubernetes.io/name=adaserve,app.kubernetes.io/instance=llama,app.kubernetes.io/component=worker"


@pytest.fixture
def spec() -> DeploymentSpec:
    return parse_spec({"model": {"target": "/m/t", "draft": "/m/d"}, "image": "w", "replicas": 2,
                       "sloClasses": [{"name": "chat", "tpotMs": 50}], "gateway": {"image": "g"},
                       "redis": {"managed": True}})


def deployment(ready: int, *, replicas: int | None = None, generation: int = 1, observed: int = 1,
               conditions: list[dict[str, str]] | None = None) -> dict[str, Any]:
    n = ready if replicas is None else replicas
    return {"metadata": {"generation": generation},
            "status": {"observedGeneration": observed, "replicas": n, "updatedReplicas": n,
                       "readyReplicas": ready, "availableReplicas": ready, "conditions": conditions or []}}


def compute(spec: DeploymentSpec | None, observed: status.Observed, **kw: Any) -> dict[str, Any]:
    return status.compute(spec, name="llama", namespace="serving", generation=3, observed=observed,
                          now=kw.pop("now", NOW), **kw)


def conditions(s: dict[str, Any]) -> dict[str, tuple[str, str]]:
    return {c["type"]: (c["status"], c["reason"]) for c in s["conditions"]}


def test_ready_status_whole(spec: DeploymentSpec) -> None:
    workers = [{"id": "w-1", "address": "http://10.0.0.7:8000", "device": "H100", "budget": 256, "status": "ready"}]
    s = compute(spec, status.Observed(worker=deployment(2), gateway=deployment(1), redis=deployment(1),
                                      workers=workers))
    message = "workers 2/2 ready; gateway 1/1 ready; redis 1/1 ready"
    assert s == {
        "phase": "Ready",
        "observedGeneration": 3,
        "replicas": 2,
        "readyWorkers": 2,
        "workers": workers,
        "gatewayUrl": "http://llama-gateway.serving.svc:80",
        "selector": SELECTOR,
        "conditions": [
            {"type": "Ready", "status": "True", "reason": "AllReady", "message": message, "lastTransitionTime": NOW},
            {"type": "Progressing", "status": "False", "reason": "Complete", "message": message,
             "lastTransitionTime": NOW},
            {"type": "Degraded", "status": "False", "reason": "AsExpected", "message": message,
             "lastTransitionTime": NOW},
        ],
    }


def test_pending_until_every_child_exists(spec: DeploymentSpec) -> None:
    s = compute(spec, status.Observed(worker=deployment(0, replicas=2)))
    assert s["phase"] == "Pending" and s["readyWorkers"] == 0 and s["workers"] == []
    assert conditions(s) == {"Ready": ("False", "Creating"), "Progressing": ("True", "Creating"),
                             "Degraded": ("False", "AsExpected")}
    assert s["conditions"][0]["message"] == "waiting for gateway, redis to be created"


@pytest.mark.parametrize("worker", [
    deployment(1, replicas=2),  # one worker still loading or profiling
    deployment(2, generation=4, observed=3),  # the Deployment controller has not seen the new template yet
    {"metadata": {}, "status": {"replicas": 3, "updatedReplicas": 2, "readyReplicas": 3, "availableReplicas": 3}},
])
def test_progressing_while_workers_load_or_roll(spec: DeploymentSpec, worker: dict[str, Any]) -> None:
    s = compute(spec, status.Observed(worker=worker, gateway=deployment(1), redis=deployment(1)))
    assert s["phase"] == "Progressing"
    assert conditions(s)["Progressing"] == ("True", "RollingOut") and conditions(s)["Ready"][0] == "False"


def test_degraded_when_a_rollout_fails(spec: DeploymentSpec) -> None:
    stuck = deployment(1, replicas=2, conditions=[
        {"type": "Progressing", "status": "False", "reason": "ProgressDeadlineExceeded", "message": "too slow"}])
    s = compute(spec, status.Observed(worker=stuck, gateway=deployment(1), redis=deployment(1)))
    assert s["phase"] == "Degraded"
    assert conditions(s) == {"Ready": ("False", "RolloutFailed"), "Progressing": ("False", "RolloutFailed"),
                             "Degraded": ("True", "RolloutFailed")}
    assert s["conditions"][2]["message"] == "workers: ProgressDeadlineExceeded: too slow"


def test_invalid_spec_is_failed_with_the_error(spec: DeploymentSpec) -> None:
    s = compute(None, status.Observed(worker=deployment(2)), error="spec.redis: set exactly one")
    assert s["phase"] == "Failed" and s["gatewayUrl"] is None and s["readyWorkers"] == 2
    assert conditions(s) == {"Ready": ("False", "InvalidSpec"), "Progressing": ("False", "InvalidSpec"),
                             "Degraded": ("True", "InvalidSpec")}
    assert all(c["message"] == "spec.redis: set exactly one" for c in s["conditions"])


def test_transition_time_moves_only_when_the_status_does(spec: DeploymentSpec) -> None:
    loading = status.Observed(worker=deployment(1, replicas=2), gateway=deployment(1), redis=deployment(1))
    first = compute(spec, loading)
    again = compute(spec, loading, previous=first["conditions"], now=LATER)
    assert again == first  # nothing changed: not even the times (so no status write)
    ready = compute(spec, status.Observed(worker=deployment(2), gateway=deployment(1), redis=deployment(1)),
                    previous=first["conditions"], now=LATER)
    times = {c["type"]: c["lastTransitionTime"] for c in ready["conditions"]}
    assert times == {"Ready": LATER, "Progressing": LATER, "Degraded": NOW}


EXTERNAL = {"model": {"target": "/m/t"}, "image": "w", "sloClasses": [{"name": "c", "tpotMs": 9}],
            "speculation": {"policy": "incremental"}, "gateway": {"image": "g"}, "redis": {"url": "redis://r:6379/0"}}


def test_external_redis_is_not_waited_for() -> None:
    s = compute(parse_spec(EXTERNAL), status.Observed(worker=deployment(1), gateway=deployment(1)))
    assert s["phase"] == "Ready"


def test_registrations_become_worker_entries() -> None:
    regs = [parse_registration(d) for d in (
        {"worker_id": "b", "address": "http://10.0.0.8:8000", "status": "loading"},  # no device, no budget yet
        {"worker_id": "a", "address": "http://10.0.0.7:8000", "status": "ready", "device": "H100", "budget": 256,
         "load": {"active": 3}},
    )]
    assert status.worker_entries(r for r in regs if r is not None) == [
        {"id": "a", "address": "http://10.0.0.7:8000", "device": "H100", "budget": 256, "status": "ready"},
        {"id": "b", "address": "http://10.0.0.8:8000", "device": "", "budget": None, "status": "loading"},
    ]


def test_status_changes_only_what_differs() -> None:
    old = {"phase": "Ready", "readyWorkers": 2, "gatewayUrl": "http://x"}
    assert status_changes({"phase": "Ready", "readyWorkers": 1, "gatewayUrl": "http://x"}, old) == {"readyWorkers": 1}
    assert status_changes({"phase": "Failed", "gatewayUrl": None, "workers": None}, old) == {
        "phase": "Failed", "gatewayUrl": None}  # None removes a key the old status has, and only then


REFUSED = "Redis at r:6379: Error 111 connecting to r:6379. Connection refused."


def test_unreadable_redis_sets_degraded_but_not_the_phase() -> None:
    spec = parse_spec(EXTERNAL)
    s = compute(spec, status.Observed(worker=deployment(1), gateway=deployment(1), redis_error=REFUSED))
    # the pods may reach a Redis the operator cannot: Ready stays the kubelet's verdict
    assert s["phase"] == "Ready" and s["workers"] == []
    assert conditions(s) == {"Ready": ("True", "AllReady"), "Progressing": ("False", "Complete"),
                             "Degraded": ("True", "RedisUnreachable")}
    assert s["conditions"][2]["message"] == f"cannot read worker registrations from {REFUSED}"
    assert s["conditions"][0]["message"] == "workers 1/1 ready; gateway 1/1 ready"


def test_redis_condition_clears_when_redis_is_read_again() -> None:
    spec = parse_spec(EXTERNAL)
    down = compute(spec, status.Observed(worker=deployment(1), gateway=deployment(1), redis_error=REFUSED))
    up = compute(spec, status.Observed(worker=deployment(1), gateway=deployment(1), workers=[]),
                 previous=down["conditions"], now=LATER)
    degraded = up["conditions"][2]
    assert (degraded["status"], degraded["reason"], degraded["lastTransitionTime"]) == ("False", "AsExpected", LATER)
    assert up["conditions"][0]["lastTransitionTime"] == NOW  # Ready did not move


def test_managed_redis_counts_as_unreachable_only_once_it_runs(spec: DeploymentSpec) -> None:
    starting = status.Observed(worker=deployment(0, replicas=2), gateway=deployment(1),
                               redis=deployment(0, replicas=1), redis_error=REFUSED)
    assert conditions(compute(spec, starting))["Degraded"] == ("False", "AsExpected")  # normal while it starts
    running = status.Observed(worker=deployment(0, replicas=2), gateway=deployment(1), redis=deployment(1),
                              redis_error=REFUSED)
    s = compute(spec, running)
    assert s["phase"] == "Progressing" and conditions(s)["Degraded"] == ("True", "RedisUnreachable")


def test_a_failed_rollout_keeps_its_reason_and_adds_the_redis_problem() -> None:
    stuck = deployment(0, replicas=1, conditions=[
        {"type": "ReplicaFailure", "status": "True", "reason": "FailedCreate", "message": "quota"}])
    s = compute(parse_spec(EXTERNAL), status.Observed(worker=stuck, gateway=deployment(1), redis_error=REFUSED))
    assert s["phase"] == "Degraded" and conditions(s)["Degraded"] == ("True", "RolloutFailed")
    assert s["conditions"][2]["message"] == (
        f"workers: FailedCreate: quota; cannot read worker registrations from {REFUSED}")


def test_an_invalid_spec_ignores_redis() -> None:
    s = compute(None, status.Observed(redis_error=REFUSED), error="spec.redis: bad")
    assert conditions(s)["Degraded"] == ("True", "InvalidSpec") and s["conditions"][2]["message"] == "spec.redis: bad"


def test_name_conflict_is_degraded_and_names_the_objects(spec: DeploymentSpec) -> None:
    # the foreign ConfigMap is not in the observed children: it is not ours to report on
    s = compute(spec, status.Observed(worker=deployment(2), gateway=deployment(1), redis=deployment(1),
                                      conflicts=("ConfigMap/llama-slo-classes", "Service/llama-worker")))
    assert s["phase"] == "Degraded"
    assert conditions(s) == {"Ready": ("False", "NameConflict"), "Progressing": ("False", "NameConflict"),
                             "Degraded": ("True", "NameConflict")}
    message = s["conditions"][2]["message"]
    assert message.startswith("ConfigMap/llama-slo-classes, Service/llama-worker: the name is taken by an object")
    assert "does not own" in message


def test_a_conflicting_worker_deployment_is_not_pending_but_a_conflict(spec: DeploymentSpec) -> None:
    s = compute(spec, status.Observed(gateway=deployment(1), redis=deployment(1),
                                      conflicts=("Deployment/llama-worker",)))
    assert s["phase"] == "Degraded" and s["replicas"] == 0 and s["readyWorkers"] == 0
