"""The lone-request figures a worker publishes: one prompt shaped like each default class's traffic, each class's
TPOT served alone and their median (``lone_tpot_ms_by_class``, ``lone_tpot_ms``)."""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest

from adaserve.engine.engine import Engine
from adaserve.gateway.slo import DEFAULT_CLASSES
from adaserve.worker.lone import LONE_PROMPTS, LONE_TOKENS, lone_prompt_ids, measure_lone
from tests.engine.helpers import engine


@pytest.fixture
def eng(target_dir: Path, draft_dir: Path) -> Engine:
    return engine(target_dir, draft_dir, "adaserve")


def test_one_prompt_per_default_class_shaped_like_its_traffic() -> None:
    assert set(LONE_PROMPTS) == {c.name for c in DEFAULT_CLASSES}
    assert LONE_PROMPTS["coding"].startswith("def ") and '"""' in LONE_PROMPTS["coding"]  # HumanEval's shape
    # the loadtest summarizes 1.6k-3.2k characters of Python: the longest prompt by far
    assert len(LONE_PROMPTS["summarization"]) > 1600 > 4 * len(LONE_PROMPTS["chat"])


def test_one_prompt_of_each_kind_without_a_tokenizer(eng: Engine) -> None:
    prompts = lone_prompt_ids(eng, None)
    assert set(prompts) == set(LONE_PROMPTS)
    assert len(prompts["chat"]) < len(prompts["coding"]) < len(prompts["summarization"])
    assert all(0 <= t < eng.target.vocab_size for p in prompts.values() for t in p)
    assert all(len(p) + LONE_TOKENS <= eng.max_context for p in prompts.values())


def test_each_class_alone_its_median_and_every_iteration(eng: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    served: dict[str, float] = {}
    run = eng.run

    def record(arrivals: list) -> None:
        run(arrivals)
        req = arrivals[0][1]
        served[req.request_id] = req.metrics.tpot_ms

    monkeypatch.setattr(eng, "run", record)
    lone = measure_lone(eng, lone_prompt_ids(eng, None))
    assert lone.by_class == {c: served[f"lone-{c}"] for c in LONE_PROMPTS}
    assert lone.median_ms == statistics.median(served.values())
    # each request emits LONE_TOKENS tokens, at least one per iteration, and every iteration is handed on
    assert 3 <= len(lone.steps) <= 3 * LONE_TOKENS and not eng.history and not eng.step_listeners
    # each verifying iteration says which class gained what: the curve's first per-class figures
    verifying = [gained for m, gained in lone.steps if m.per_request_verified]
    assert verifying and all(len(g) == 1 for g in verifying)
    assert {cls for g in verifying for cls, _ in g.values()} == set(LONE_PROMPTS)
    assert all(0 <= k <= eng.cfg.budget for g in verifying for _, k in g.values())


def test_a_prompt_the_engine_refuses_is_left_out(eng: Engine) -> None:
    too_long = [5] * (eng.max_context + 1)
    lone = measure_lone(eng, {"summarization": too_long, "chat": [5, 6, 7]})
    assert set(lone.by_class) == {"chat"} and lone.steps and lone.median_ms == lone.by_class["chat"]
    nothing = measure_lone(eng, {"summarization": too_long})
    assert nothing.by_class == {} and nothing.steps == [] and nothing.median_ms is None
