"""``adaserve up``'s derived SLO classes: each default class scaled from what a lone request of it gets, and never
tighter than what the gateway, which judges feasibility and admits, predicts for one."""

from __future__ import annotations

import copy

import pytest

from adaserve.cli.up import lone_bases
from adaserve.contract.registration import parse_registration
from adaserve.gateway.directory import worker_view
from adaserve.gateway.prediction import lone_tpot_ms
from adaserve.gateway.slo import LOCAL_MULTIPLIERS, SloCatalog, class_feasibility, local_classes
from tests.contract.examples import REGISTRATION


def test_each_class_from_the_slower_of_its_measured_and_predicted_lone_tpot() -> None:
    doc = copy.deepcopy(REGISTRATION)
    # coding measured faster than predicted (a prompt the draft guessed well), summarization slower
    doc["lone_tpot_ms_by_class"] = {"coding": 5.0, "chat": 14.2, "summarization": 60.0}
    reg = parse_registration(doc)
    assert reg is not None
    view = worker_view(reg)
    bases = lone_bases(reg)
    assert bases["coding"] == pytest.approx(lone_tpot_ms(view, "coding")) and bases["coding"] > 5.0
    assert bases["summarization"] == 60.0
    assert bases["chat"] == pytest.approx(max(14.2, lone_tpot_ms(view, "chat") or 0.0))
    # so the gateway finds every derived class feasible on that worker, with its 10% admission margin
    classes = local_classes(reg.lone_tpot_ms or 0.0, bases)
    catalog = SloCatalog.of(classes, "chat")
    for c in catalog.classes.values():
        assert c.tpot_ms == pytest.approx(LOCAL_MULTIPLIERS[c.name] * bases[c.name], abs=0.5)
        assert class_feasibility(c, [view], margin=0.1)["feasibility"] in ("plain", "speculation"), c.name


def test_a_worker_that_measured_nothing_yet_gives_the_prediction_alone() -> None:
    doc = copy.deepcopy(REGISTRATION)
    doc.pop("lone_tpot_ms_by_class", None)
    reg = parse_registration(doc)
    assert reg is not None
    view = worker_view(reg)
    assert lone_bases(reg) == {c: lone_tpot_ms(view, c) for c in LOCAL_MULTIPLIERS}
