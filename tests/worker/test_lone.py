"""The lone-request figure a worker publishes (``lone_tpot_ms``): several kinds of request, their median."""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest

from adaserve.engine.engine import Engine
from adaserve.worker.runtime import LONE_PROMPTS, LONE_TOKENS, lone_prompt_ids, measure_lone
from tests.engine.helpers import engine


@pytest.fixture
def eng(target_dir: Path, draft_dir: Path) -> Engine:
    return engine(target_dir, draft_dir, "adaserve")


def test_one_prompt_of_each_kind_without_a_tokenizer(eng: Engine) -> None:
    prompts = lone_prompt_ids(eng, None)
    assert len(prompts) == len(LONE_PROMPTS) == 3
    assert len({len(p) for p in prompts}) == 3  # a short, a middling and a long prompt
    assert all(0 <= t < eng.target.vocab_size for p in prompts for t in p)


def test_the_median_of_each_prompts_tpot_and_every_iteration(eng: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    served: list[float] = []
    run = eng.run

    def record(arrivals: list) -> None:
        run(arrivals)
        served.append(arrivals[0][1].metrics.tpot_ms)

    monkeypatch.setattr(eng, "run", record)
    tpot, steps = measure_lone(eng, lone_prompt_ids(eng, None))
    assert len(served) == 3 and tpot == statistics.median(served)
    # each request emits LONE_TOKENS tokens, at least one per iteration, and every iteration is handed on
    assert 3 <= len(steps) <= 3 * LONE_TOKENS and not eng.history


def test_a_prompt_the_engine_refuses_is_left_out(eng: Engine) -> None:
    too_long = [5] * (eng.max_context + 1)
    tpot, steps = measure_lone(eng, [too_long, [5, 6, 7]])
    assert tpot is not None and steps
    assert measure_lone(eng, [too_long]) == (None, [])
