"""The simulated clock: every forward priced by the device model, nothing read from the wall clock."""

from __future__ import annotations

from pathlib import Path

import pytest

from adaserve.bench.sim.clock import SimClock, SimTotals, priced, run_simulated
from adaserve.bench.sim.device_model import DeviceProfile, load_profile_file
from adaserve.engine.config import EngineConfig
from adaserve.engine.engine import Engine
from adaserve.engine.model.runner import ForwardRecord
from adaserve.engine.request import Request
from adaserve.engine.speculation.sampling import SamplingParams
from tests.engine.helpers import runner

PAPER = "a100-80g-tp4/llama-3.1-70b"


def arrivals(n: int = 6) -> list[tuple[float, Request]]:
    return [(0.01 * i, Request(f"r{i}", [1 + i, 5, 9, 2 + i], SamplingParams(max_tokens=12, ignore_eos=True),
                               tpot_slo_ms=30.0 + 10 * i)) for i in range(n)]


def simulate(target_dir: Path, draft_dir: Path, policy: str, device: DeviceProfile,
             sched_s: float = 0.001) -> tuple[list[Request], SimClock, Engine, list[ForwardRecord]]:
    clock = SimClock()
    cfg = EngineConfig(policy=policy, budget=16)
    draft = runner(draft_dir) if policy != "incremental" else None
    eng = Engine(runner(target_dir), draft, cfg, clock=clock)
    seen: list[ForwardRecord] = []
    eng.target.forward_listeners.append(seen.append)
    reqs = arrivals()
    run_simulated(eng, reqs, device, clock, sched_s=sched_s)
    return [r for _, r in reqs], clock, eng, seen


def test_each_iteration_lasts_what_the_device_charges_for_its_forwards(target_dir: Path, draft_dir: Path) -> None:
    device = load_profile_file(PAPER)
    clock = SimClock()
    eng = Engine(runner(target_dir), runner(draft_dir), EngineConfig(policy="adaserve", budget=16), clock=clock)
    records: list[tuple[str, ForwardRecord]] = []
    eng.target.forward_listeners.append(lambda r: records.append(("target", r)))
    assert eng.draft is not None
    eng.draft.forward_listeners.append(lambda r: records.append(("draft", r)))
    totals = run_simulated(eng, arrivals(), device, clock, sched_s=0.002)
    # replay: every recorded forward at the device's price, plus the scheduler's 2 ms per iteration
    cost = {"target": device.target, "draft": device.draft}
    charged = sum(cost[k].seconds(r.n_new, r.n_context) for k, r in records)
    assert totals.target_s + totals.draft_s == pytest.approx(charged)
    assert sum(totals.per_step_s) == pytest.approx(charged + 0.002 * totals.iterations)
    assert clock() == pytest.approx(totals.busy_s + totals.idle_s)
    # an iteration is one target forward and d draft forwards: never shorter than one target forward
    assert min(totals.per_step_s) >= device.target.seconds(1, 0)


def test_same_inputs_give_the_same_times_and_tokens(target_dir: Path, draft_dir: Path) -> None:
    device = load_profile_file(PAPER)
    a, clock_a, _, _ = simulate(target_dir, draft_dir, "adaserve", device)
    b, clock_b, _, _ = simulate(target_dir, draft_dir, "adaserve", device)
    assert clock_a() == clock_b()
    for x, y in zip(a, b, strict=True):
        assert x.output_ids == y.output_ids
        assert (x.metrics.first_token_s, x.metrics.last_token_s) == (y.metrics.first_token_s, y.metrics.last_token_s)


def test_speculation_stays_lossless_and_pays_on_the_simulated_device(target_dir: Path, draft_dir: Path) -> None:
    device = load_profile_file(PAPER)
    plain, _, _, _ = simulate(target_dir, draft_dir, "incremental", device)
    spec, _, eng, _ = simulate(target_dir, draft_dir, "adaserve", device)
    assert [r.output_ids for r in spec] == [r.output_ids for r in plain]
    # per-token time of a lone request, no speculation: one target forward plus the scheduler's share
    one = plain[0]
    assert one.metrics.tpot_ms is not None and one.metrics.tpot_ms >= 1e3 * device.target.seconds(1, 0)
    assert all(m.budget >= 16 for m in eng.history if m.n_decode)  # the knee is a floor


def test_the_engine_must_read_the_clock_it_is_run_on(target_dir: Path) -> None:
    eng = Engine(runner(target_dir), None, EngineConfig(policy="incremental"))
    with pytest.raises(ValueError, match="simulated clock"):
        run_simulated(eng, [], load_profile_file(PAPER), SimClock(), sched_s=0.0)


def test_forward_listeners_are_detached_after_the_run(target_dir: Path) -> None:
    clock = SimClock()
    r = runner(target_dir)
    with priced(r, None, load_profile_file(PAPER), clock, SimTotals()):
        assert len(r.forward_listeners) == 1
    assert r.forward_listeners == []
