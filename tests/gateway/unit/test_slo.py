"""slo.py: parsing SLO classes (both spellings), sheddability, catalog checks and class resolution."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from adaserve.gateway.slo import DEFAULT_CLASSES, SloCatalog, SloClass, UnknownClass, load_catalog, parse_classes


def classes_json(*classes: dict[str, Any]) -> str:
    return json.dumps(list(classes))


def catalog(*names: str, default: str | None = None) -> SloCatalog:
    return SloCatalog.of([SloClass(name=n, tpot_ms=10.0 * (i + 1)) for i, n in enumerate(names)], default)


def test_parse_camel_case() -> None:
    (c,) = parse_classes(classes_json({"name": "coding", "tpotMs": 40, "ttftMs": 2000, "priority": 10}), source="t")
    assert (c.name, c.tpot_ms, c.ttft_ms, c.priority, c.sheddable) == ("coding", 40.0, 2000.0, 10, False)


def test_parse_snake_case() -> None:
    (c,) = parse_classes(classes_json({"name": "batch", "tpot_ms": 200, "ttft_ms": 9000, "priority": 3}), source="t")
    assert (c.name, c.tpot_ms, c.ttft_ms, c.priority) == ("batch", 200.0, 9000.0, 3)


def test_parse_defaults_and_spec_fragment() -> None:
    text = json.dumps({"sloClasses": [{"name": "chat", "tpotMs": 50}]})  # a pasted AdaServeDeployment fragment
    (c,) = parse_classes(text, source="t")
    assert (c.ttft_ms, c.priority, c.sheddable) == (None, 0, False)
    assert c.public() == {"name": "chat", "tpot_ms": 50.0, "ttft_ms": None, "priority": 0, "sheddable": False}


@pytest.mark.parametrize(("fields", "sheddable"), [
    ({"priority": 0}, False),
    ({"priority": 5}, False),
    ({"priority": -1}, True),  # the llm-d convention
    ({"priority": -1, "sheddable": False}, False),  # the explicit flag wins
    ({"priority": 5, "sheddable": True}, True),
    ({"sheddable": True}, True),
])
def test_sheddable(fields: dict[str, Any], sheddable: bool) -> None:
    (c,) = parse_classes(classes_json({"name": "x", "tpotMs": 50, **fields}), source="t")
    assert c.sheddable is sheddable
    assert c.public()["sheddable"] is sheddable


def test_duplicate_names_are_named() -> None:
    text = classes_json({"name": "chat", "tpotMs": 50}, {"name": "coding", "tpotMs": 40},
                        {"name": "chat", "tpotMs": 60})
    with pytest.raises(ValueError, match="repeated: chat") as e:
        load_catalog(file=None, inline=text, default=None)
    assert "coding" not in str(e.value)


def test_bad_json_names_the_source(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"^/etc/slo\.json: not JSON"):
        parse_classes("[{", source="/etc/slo.json")
    path = tmp_path / "classes.json"
    path.write_text("{nope")
    with pytest.raises(ValueError, match=re.escape(str(path))):
        load_catalog(file=path, inline=None, default=None)
    with pytest.raises(ValueError, match=r"^slo_classes: not JSON"):
        load_catalog(file=None, inline="nope", default=None)


@pytest.mark.parametrize("tpot", [0, -5, 0.0])
def test_non_positive_tpot_is_rejected(tpot: float) -> None:
    with pytest.raises(ValueError, match=r"src: \[0\.tpotMs\] Input should be greater than 0"):
        parse_classes(classes_json({"name": "chat", "tpotMs": tpot}), source="src")


@pytest.mark.parametrize(("cls", "where"), [
    ({"name": "chat"}, "0.tpotMs"),  # required
    ({"name": "chat", "tpotMs": 50, "ttftMs": 0}, "0.ttftMs"),
    ({"name": "chat", "tpotMs": 50, "tpot": 3}, "0.tpot"),  # unknown fields are not ignored
    ({"name": "two words", "tpotMs": 50}, "0.name"),
])
def test_other_invalid_classes_name_the_field(cls: dict[str, Any], where: str) -> None:
    with pytest.raises(ValueError, match=rf"\[{where}\]"):
        parse_classes(classes_json(cls), source="src")


def test_a_bare_object_is_not_a_list() -> None:
    with pytest.raises(ValueError, match="valid list"):
        parse_classes(json.dumps({"name": "chat", "tpotMs": 50}), source="src")


def test_default_class_must_exist() -> None:
    with pytest.raises(ValueError, match="'fast' is not one of a, b"):
        catalog("a", "b", default="fast")
    with pytest.raises(ValueError, match="'fast'"):
        load_catalog(file=None, inline=classes_json({"name": "a", "tpotMs": 5}), default="fast")
    with pytest.raises(ValueError, match="at least one"):
        load_catalog(file=None, inline="[]", default=None)


def test_default_is_the_first_class_unless_given() -> None:
    assert catalog("b", "a").default == "b"
    assert catalog("b", "a", default="a").default == "a"


def test_builtin_classes_default_to_chat() -> None:
    cat = load_catalog(file=None, inline=None, default=None)
    assert list(cat.classes) == ["coding", "chat", "summarization"] and cat.default == "chat"
    assert [c.sheddable for c in DEFAULT_CLASSES] == [False, False, True]
    assert load_catalog(file=None, inline=None, default="coding").default == "coding"


def test_load_catalog_from_a_file(tmp_path: Path) -> None:
    path = tmp_path / "classes.json"
    path.write_text(classes_json({"name": "fast", "tpotMs": 20, "ttftMs": 500, "priority": 1},
                                 {"name": "slow", "tpot_ms": 200, "priority": -3}))
    cat = load_catalog(file=path, inline=None, default=None)
    assert list(cat.classes) == ["fast", "slow"] and cat.default == "fast"
    assert cat.classes["fast"].ttft_ms == 500.0 and cat.classes["slow"].sheddable
    assert cat.tpot_of("slow") == 200.0 and cat.tpot_of("missing") is None


def test_load_catalog_from_a_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"cannot read SLO classes file .*missing\.json"):
        load_catalog(file=tmp_path / "missing.json", inline=None, default=None)


def test_resolve_precedence_header_body_key_default() -> None:
    cat = catalog("h", "b", "k", "d", default="d")
    assert cat.resolve(header="h", body="b", key_default="k").name == "h"
    assert cat.resolve(header=None, body="b", key_default="k").name == "b"
    assert cat.resolve(header=None, body=None, key_default="k").name == "k"
    assert cat.resolve(header=None, body=None, key_default=None).name == "d"
    assert cat.resolve(header="", body="", key_default=None).name == "d"  # empty header = not given


def test_resolve_unknown_lists_the_valid_classes() -> None:
    cat = catalog("chat", "coding")
    with pytest.raises(UnknownClass, match=r"unknown SLO class 'nope'; valid classes: chat, coding") as e:
        cat.resolve(header="nope", body="chat", key_default=None)  # a bad header is not overridden by the body
    assert e.value.name == "nope" and e.value.known == ["chat", "coding"]
    with pytest.raises(UnknownClass):
        cat.resolve(header=None, body=None, key_default="gone")


def test_local_classes_scale_the_defaults_to_this_machine() -> None:
    from adaserve.gateway.slo import DEFAULT_CLASSES, local_classes

    local = local_classes(64.0)
    assert [(c.name, c.tpot_ms) for c in local] == [("coding", 128.0), ("chat", 160.0), ("summarization", 384.0)]
    # only the targets change: priorities, TTFT and sheddability are the defaults'
    for mine, default in zip(local, DEFAULT_CLASSES, strict=True):
        assert (mine.priority, mine.ttft_ms, mine.sheddable) == (default.priority, default.ttft_ms, default.sheddable)
    with pytest.raises(ValueError, match="positive"):
        local_classes(0.0)


def test_local_classes_scale_each_class_by_its_own_lone_request() -> None:
    from adaserve.gateway.slo import local_classes

    # a HumanEval-shaped prompt alone is slower than the median: coding's target follows its own figure;
    # a class the worker did not measure falls back on the median
    local = local_classes(30.0, {"coding": 40.0, "summarization": 70.0})
    assert [(c.name, c.tpot_ms) for c in local] == [("coding", 80.0), ("chat", 75.0), ("summarization", 420.0)]
    with pytest.raises(ValueError, match="positive"):
        local_classes(30.0, {"chat": 0.0})


def test_feasibility_of_a_lone_request() -> None:
    from adaserve.gateway.slo import feasibility

    assert feasibility(50, unloaded_tpot_ms=None, max_depth=4) is None
    assert feasibility(64, unloaded_tpot_ms=64, max_depth=4) == "plain"
    assert feasibility(40, unloaded_tpot_ms=64, max_depth=4) == "speculation"
    assert feasibility(12.8, unloaded_tpot_ms=64, max_depth=4) == "speculation"  # t1 / (D + 1) exactly
    assert feasibility(12.7, unloaded_tpot_ms=64, max_depth=4) == "infeasible"
    assert feasibility(40, unloaded_tpot_ms=64, max_depth=0) == "infeasible"  # no draft: plain decoding only


def test_feasibility_measured_overrules_the_profile() -> None:
    from adaserve.gateway.slo import feasibility

    # one forward takes 43 ms, but a lone request as served (speculation included) gets 80 ms per token
    assert feasibility(65, unloaded_tpot_ms=43, max_depth=4, lone_tpot_ms=80) == "infeasible"
    assert feasibility(90, unloaded_tpot_ms=43, max_depth=4, lone_tpot_ms=80) == "plain"
    # speculation that works: 30 ms per token alone against a 64 ms forward
    assert feasibility(40, unloaded_tpot_ms=64, max_depth=4, lone_tpot_ms=30) == "speculation"
    assert feasibility(12, unloaded_tpot_ms=64, max_depth=4, lone_tpot_ms=10) == "speculation"  # beyond t1/(D+1)
    assert feasibility(40, unloaded_tpot_ms=None, max_depth=None, lone_tpot_ms=30) == "plain"
    assert feasibility(20, unloaded_tpot_ms=None, max_depth=None, lone_tpot_ms=30) == "infeasible"


def test_class_feasibility_takes_the_most_capable_worker() -> None:
    from adaserve.gateway.slo import class_feasibility
    from adaserve.gateway.view import CurvePoint
    from tests.gateway.unit.helpers import view

    slow = view("slow", unloaded_tpot_ms=100.0, draft_steps=0, curve=(CurvePoint(1, 32, 100.0, 1.0),))
    fast = view("fast", unloaded_tpot_ms=60.0, draft_steps=4, curve=(CurvePoint(1, 32, 50.0, 2.0),))
    silent = view("silent")
    cls = {c: SloClass(name="chat", tpot_ms=c) for c in (80, 30, 20)}
    assert class_feasibility(cls[80], [slow, silent]) == {"feasibility": "infeasible", "lone_tpot_ms": 100.0}
    assert class_feasibility(cls[80], [slow, fast, silent]) == {"feasibility": "plain", "lone_tpot_ms": 25.0}
    assert class_feasibility(cls[30], [slow, fast]) == {"feasibility": "speculation", "lone_tpot_ms": 25.0}
    assert class_feasibility(cls[20], [slow, fast]) == {"feasibility": "infeasible", "lone_tpot_ms": 25.0}
    assert class_feasibility(cls[30], [silent]) == {"feasibility": None, "lone_tpot_ms": None}
    assert class_feasibility(cls[30], []) == {"feasibility": None, "lone_tpot_ms": None}
