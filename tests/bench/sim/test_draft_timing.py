"""The engine times each draft forward alone (issue 14): in the simulated clock, with the device's own
profile, the online correction leaves the draft's cost model alone.

Before, the engine timed the whole beam search and divided by its depth, calling each part an n * w
forward, while the first forward also ran every request's catch-up tokens (a request's whole prompt on
its first decoding iteration): the correction then scaled a correct draft profile by 1.2-1.9x
("predictions scaled by" in the run logs).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from adaserve.bench.sim.clock import SimClock, run_simulated
from adaserve.bench.sim.device_model import load_profile_file
from adaserve.bench.sim.profile import costs_of, simulated_profile
from adaserve.engine.config import EngineConfig
from adaserve.engine.cost.timing import SampleIn, median_ratio
from adaserve.engine.engine import Engine, StepMetrics
from adaserve.engine.model.runner import ForwardRecord
from adaserve.engine.request import Request
from adaserve.engine.speculation.sampling import SamplingParams
from tests.engine.helpers import runner

PAPER = "a100-80g-tp4/llama-3.1-70b"


def test_draft_correction_stays_near_one_on_the_simulated_device(target_dir: Path, draft_dir: Path) -> None:
    device = load_profile_file(PAPER)
    budget, target_cost, draft_cost = costs_of(simulated_profile(device))
    clock = SimClock()
    cfg = EngineConfig(policy="chain:4", budget=budget, target_cost=target_cost, draft_cost=draft_cost)
    eng = Engine(runner(target_dir), runner(draft_dir), cfg, clock=clock)
    assert eng.draft is not None
    forwards: list[ForwardRecord] = []
    eng.draft.forward_listeners.append(forwards.append)
    steps: list[tuple[int, StepMetrics]] = []  # (draft forwards before the step's, the step)
    eng.step_listeners.append(lambda m: steps.append((len(forwards) - m.depth, m)))
    # long prompts arriving one after another: a request's first decoding iteration drafts its whole prompt,
    # past the draft's knee (~130 tokens on this device), so that forward costs more than a beam step
    reqs = [(0.03 * i, Request(f"r{i}", [2 + (7 * i + j) % 90 for j in range(300 + 8 * i)],
                               SamplingParams(max_tokens=24, ignore_eos=True), tpot_slo_ms=40.0))
            for i in range(16)]
    run_simulated(eng, reqs, device, clock, sched_s=0.001)
    assert all(r.finish_reason == "length" for _, r in reqs)
    observed = list(eng.draft_time.samples)
    assert len(observed) >= 3 * eng.draft_time.min_samples  # enough forwards for the correction to act
    # every sample is one forward at the device's price for its own counts (a simulated clock has no host time)
    priced = [(f.n_context, f.n_new, device.draft.seconds(f.n_new, f.n_context)) for f in forwards]
    assert [(c, b) for c, b, _, _ in observed] == [(c, b) for c, b, _ in priced[-len(observed):]]
    assert [y for _, _, y, _ in observed] == pytest.approx([y for _, _, y in priced[-len(observed):]])
    assert [k for *_, k in observed] == [f.n_cells for f in forwards[-len(observed):]]  # and each forward's cells
    k = median_ratio(draft_cost, observed)
    assert k is not None and abs(k - 1) < 0.1
    assert eng.draft_time.source == "initial" and eng.draft_time.correction == 1.0
    # the old attribution on the iterations whose first forward drafted a prompt (past the draft's knee):
    # the span over the depth, as n * w tokens each, read the draft as dearer than its profile
    old: list[SampleIn] = []
    for first, m in steps:
        if m.depth and forwards[first].n_new > 256:
            f = forwards[first]
            old.append((f.n_context + f.n_new, m.n_decode * m.width, m.t_speculate_s / m.depth))
    k_old = median_ratio(draft_cost, old)
    assert len(old) >= 8 and k_old is not None and k_old > 1.2
