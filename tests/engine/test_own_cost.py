"""Every step reports its wall time and the part spent inside model forwards (the engine's own cost)."""

from __future__ import annotations

import itertools
import time
from pathlib import Path

import pytest

from adaserve.bench.engine_only import ForwardClock
from adaserve.engine.request import Request
from adaserve.engine.speculation.sampling import SamplingParams
from tests.engine.helpers import engine


@pytest.mark.parametrize("policy", ["adaserve", "incremental"])
def test_step_forward_time_counts_every_forward_of_both_models(target_dir: Path, draft_dir: Path, policy: str,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """With a clock that ticks once per read, a forward lasts exactly one tick (nothing inside it reads the
    clock): each step's forward time is then the number of forwards it ran, counted by independent hooks."""
    eng = engine(target_dir, draft_dir, policy, budget=16)
    clocks = [ForwardClock(r.model) for r in (eng.target, eng.draft) if r is not None]
    for i in range(3):
        eng.add_request(Request(f"r{i}", [5, 6, 7 + i], SamplingParams(max_tokens=6, ignore_eos=True)))
    ticks = itertools.count()
    monkeypatch.setattr(time, "perf_counter", lambda: float(next(ticks)))
    while eng.has_work:
        before = sum(c.calls for c in clocks)
        eng.step()
        m = eng.history[-1]
        assert m.t_forward_s == sum(c.calls for c in clocks) - before > 0
        assert m.t_forward_s < m.t_wall_s and 0 < m.non_forward_share < 1
        assert m.to_dict()["non_forward_share"] == m.non_forward_share
    if policy == "adaserve":  # the draft's forwards count too
        assert clocks[1].calls > 0


def test_forward_time_is_wall_time(target_dir: Path, draft_dir: Path) -> None:
    eng = engine(target_dir, draft_dir, "adaserve", budget=16)
    eng.add_request(Request("r", [5, 6, 7], SamplingParams(max_tokens=4, ignore_eos=True)))
    t0 = time.perf_counter()
    while eng.has_work:
        eng.step()
    wall = time.perf_counter() - t0
    steps = list(eng.history)
    assert 0 < sum(m.t_forward_s for m in steps) <= sum(m.t_wall_s for m in steps) <= wall


@pytest.mark.parametrize("priced", [True, False])
def test_decode_only_steps_teach_the_host_time_the_shape_rules_price(target_dir: Path, draft_dir: Path,
                                                                     priced: bool) -> None:
    """With ``EngineConfig.host_cost`` each decode-only step hands its wall minus forward seconds to
    ``Engine.host_time`` at its depth and the policy's view carries that prediction; without it, neither
    (cost/host_cost.py)."""
    from adaserve.engine.speculation.policies import BatchView

    eng = engine(target_dir, draft_dir, "adaserve", budget=16, host_cost=priced)
    seen: list[BatchView] = []
    shape = eng.policy.tree_shape  # a frozen dataclass: the spy shadows its method on this instance
    object.__setattr__(eng.policy, "tree_shape", lambda view: (seen.append(view), shape(view))[1])
    observed: list[tuple[int, int, float]] = []
    real = eng.host_time.observe
    eng.host_time.observe = lambda d, n, s: (observed.append((d, n, s)), real(d, n, s))[1]
    for i in range(2):
        eng.add_request(Request(f"r{i}", [5, 6, 7 + i], SamplingParams(max_tokens=24, ignore_eos=True)))
    while eng.has_work:
        eng.step()
    decode_only = [m for m in eng.history if m.n_decode and not m.n_prefill]
    assert [(d, n) for d, n, _ in observed] == ([(m.depth, m.n_decode) for m in decode_only] if priced else [])
    assert all(s == pytest.approx(m.t_wall_s - m.t_forward_s) for (_, _, s), m in zip(observed, decode_only,
                                                                                        strict=False))
    assert seen and all((v.predict_host is not None) == priced for v in seen)
    if priced:
        assert seen[-1].predict_host is not None and seen[-1].predict_host(2, 1) == eng.host_time.predict(2, 1)


def test_clocks_nest_and_remove_in_turn(target_dir: Path, draft_dir: Path) -> None:
    """Two clocks on one model both count its forwards; each ``remove`` gives back the forward it found."""
    eng = engine(target_dir, draft_dir, "incremental", budget=16)
    model = eng.target.model
    outer = ForwardClock(model)
    inner = ForwardClock(model)
    eng.add_request(Request("r", [5, 6, 7], SamplingParams(max_tokens=3, ignore_eos=True)))
    eng.step()
    assert outer.calls == inner.calls >= 1
    inner.remove()
    eng.step()
    assert outer.calls == inner.calls + 1
    outer.remove()
    assert "forward" not in model.__dict__
