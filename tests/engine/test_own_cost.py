"""Every step reports its wall time and the part spent inside model forwards (the engine's own cost)."""

from __future__ import annotations

from pathlib import Path

import pytest

from adaserve.bench.engine_only import ForwardClock
from adaserve.engine.request import Request
from adaserve.engine.sampling import SamplingParams
from tests.engine.helpers import engine


@pytest.mark.parametrize("policy", ["adaserve", "incremental"])
def test_step_forward_time_is_what_the_forwards_took(target_dir: Path, draft_dir: Path, policy: str) -> None:
    eng = engine(target_dir, draft_dir, policy, budget=16)
    clocks = [ForwardClock(r.model) for r in (eng.target, eng.draft) if r is not None]  # independent hooks
    for i in range(3):
        eng.add_request(Request(f"r{i}", [5, 6, 7 + i], SamplingParams(max_tokens=6, ignore_eos=True)))
    while eng.has_work:
        eng.step()
    steps = list(eng.history)
    hooked = sum(c.seconds for c in clocks)
    assert sum(m.t_forward_s for m in steps) == pytest.approx(hooked, rel=0.05, abs=2e-3)
    for m in steps:
        assert 0 < m.t_forward_s <= m.t_wall_s
        assert 0 <= m.non_forward_share < 1
        assert m.to_dict()["non_forward_share"] == m.non_forward_share
    if policy == "adaserve":  # the draft's forwards count too
        assert eng.draft is not None and eng.draft.model.forward_seconds > 0
