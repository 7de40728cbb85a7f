"""The registration document: what its readers accept as one, and that the writer's document reads back."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest

from adaserve.contract.registration import CostModels, Profile, Registration, parse_registration
from tests.contract.examples import REGISTRATION


def doc(**changes: Any) -> dict[str, Any]:
    out = copy.deepcopy(REGISTRATION)
    out.update(changes)
    return out


def test_the_documented_example_reads_back_unchanged() -> None:
    reg = parse_registration(REGISTRATION)
    assert reg is not None and reg.worker_id == "adaserve-worker-7d9f-abcde" and reg.budget == 582
    assert reg.document() == REGISTRATION  # every field of the example is in the schema, and nothing else
    assert list(reg.document())[:4] == ["schema", "worker_id", "address", "status"]


def test_a_loading_worker_has_no_profile_yet() -> None:
    reg = Registration(worker_id="w", address="http://w:8000", status="loading", **dict(Profile()))
    again = parse_registration(json.loads(json.dumps(reg.document())))
    assert again == reg and again.budget is None and again.cost_model is None


def test_unknown_fields_are_ignored_for_newer_workers() -> None:
    reg = parse_registration(doc(future_field={"x": 1}, load={**REGISTRATION["load"], "new": 2}))
    assert reg is not None and "future_field" not in reg.document()


def test_numbers_for_id_and_address_read_as_text() -> None:
    reg = parse_registration({"worker_id": 7, "address": "http://w", "status": "ready"})
    assert reg is not None and (reg.worker_id, reg.capacity.max_active_requests, reg.load.active) == ("7", None, 0)


@pytest.mark.parametrize("garbage", [
    None, "a string", 42, [REGISTRATION], {},
    {"worker_id": "w", "status": "ready"},  # no address
    {"address": "http://w", "status": "ready"},  # no id
    {"worker_id": "", "address": "http://w", "status": "ready"},
    doc(load={"active": "many"}),
    doc(load="busy"),
    doc(capacity={"max_active_requests": "lots"}),
    doc(budget="big"),
    doc(acceptance={"steps": 3}),  # verified, but no rate
    doc(models=["m"]),
    doc(cost_model={"target": {"alpha": 1e-7, "delta": 0.01}, "draft": None}),  # a coefficient missing
    doc(cost_model={"target": "fast", "draft": None}),
    doc(measured={"iterations": [{"requests": 0, "steps": 3, "iteration_ms": 10.0, "tokens_verified": 1}]}),
    doc(measured={"iterations": [{"requests": 2, "steps": 3, "iteration_ms": "slow", "tokens_verified": 1}]}),
    doc(measured={"iterations": [{"requests": 2, "steps": 3, "iteration_ms": float("nan"), "tokens_verified": 1}]}),
    doc(measured={"classes": {"chat": {"finished": 2, "met": 1, "attainment": 1.5}}}),
    doc(lone_tpot_ms=-3.0),
])
def test_what_is_not_a_registration_is_none(garbage: Any) -> None:
    assert parse_registration(garbage) is None


def test_cost_model_of_a_worker_without_draft() -> None:
    reg = parse_registration(doc(cost_model={"source": "online", "target": {"alpha": 0, "gamma": 0, "delta": 0.1},
                                             "draft": None}))
    assert reg is not None and reg.cost_model == CostModels.model_validate(
        {"source": "online", "target": {"alpha": 0.0, "gamma": 0.0, "delta": 0.1}})


def test_a_cost_model_with_attention_cells_keeps_them_and_one_without_reads_zero() -> None:
    cells = parse_registration(doc(cost_model={"source": "profile", "draft": None,
                                               "target": {"alpha": 1e-6, "gamma": 1e-4, "delta": 0.004, "beta": 3e-7}}))
    assert cells is not None and cells.cost_model is not None and cells.cost_model.target is not None
    assert cells.cost_model.target.beta == 3e-7
    assert cells.cost_model.target.model_dump()["beta"] == 3e-7  # what the gateway's view reads
    old = parse_registration(doc(cost_model={"target": {"alpha": 1e-6, "gamma": 1e-4, "delta": 0.004}}))
    assert old is not None and old.cost_model is not None and old.cost_model.target is not None
    assert old.cost_model.target.beta == 0.0
