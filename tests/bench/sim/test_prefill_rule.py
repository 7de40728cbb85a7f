"""The SLO-aware prefill chunk in the engine, on the simulated A100 (issue 14): prompts arriving behind a
request with a tight TPOT SLO are prefilled in smaller chunks while it needs the time, the tokens stay
the target's own, and the tight request's TPOT is no worse than with the fixed chunk."""

from __future__ import annotations

from pathlib import Path

from adaserve.bench.sim.clock import SimClock, run_simulated
from adaserve.bench.sim.device_model import load_profile_file
from adaserve.bench.sim.profile import costs_of, simulated_profile
from adaserve.engine.config import EngineConfig
from adaserve.engine.engine import Engine, StepMetrics
from adaserve.engine.request import Request
from adaserve.engine.speculation.sampling import SamplingParams
from tests.engine.helpers import runner

PAPER = "a100-80g-tp4/llama-3.1-70b"


def serve(target_dir: Path, draft_dir: Path, rule: str,
          ttft_ms: float | None = None) -> tuple[list[Request], list[StepMetrics]]:
    device = load_profile_file(PAPER)
    budget, target_cost, draft_cost = costs_of(simulated_profile(device))
    clock = SimClock()
    cfg = EngineConfig(policy="adaserve", budget=budget, target_cost=target_cost, draft_cost=draft_cost,
                       prefill_rule=rule)
    eng = Engine(runner(target_dir), runner(draft_dir), cfg, clock=clock)
    steps: list[StepMetrics] = []
    eng.step_listeners.append(steps.append)
    tight = Request("tight", [3, 1, 4, 1, 5], SamplingParams(max_tokens=40, ignore_eos=True), tpot_slo_ms=36.0)
    long = [Request(f"long{i}", [2 + (5 * i + j) % 80 for j in range(420)],
                    SamplingParams(max_tokens=4, ignore_eos=True), tpot_slo_ms=150.0, ttft_slo_ms=ttft_ms)
            for i in range(4)]
    arrivals = [(0.0, tight), *((0.08 + 0.01 * i, r) for i, r in enumerate(long))]
    run_simulated(eng, arrivals, device, clock, sched_s=0.001)
    return [r for _, r in arrivals], steps


def test_prompts_wait_in_smaller_chunks_while_a_tight_request_needs_the_time(target_dir: Path,
                                                                               draft_dir: Path) -> None:
    fixed, fixed_steps = serve(target_dir, draft_dir, "fixed")
    slo, slo_steps = serve(target_dir, draft_dir, "slo")
    assert [r.output_ids for r in slo] == [r.output_ids for r in fixed]  # the same tokens
    shrunk = [m.prefill_tokens for m in slo_steps if m.n_prefill and m.n_decode]
    assert shrunk and min(shrunk) < 256  # some chunks were cut for the tight request
    assert sum(m.prefill_tokens for m in slo_steps) == sum(m.prefill_tokens for m in fixed_steps)  # all prefilled
    t_fixed, t_slo = fixed[0].metrics.tpot_ms, slo[0].metrics.tpot_ms
    assert t_fixed is not None and t_slo is not None and t_slo <= t_fixed


def test_a_ttft_target_keeps_the_prompts_behind_a_tight_request_moving(target_dir: Path, draft_dir: Path) -> None:
    """The same arrivals, the long prompts now with a TTFT target: the rule may no longer hold their chunks back
    past it, so a first token that came after the target without one comes sooner, and none comes later than both
    its target and its time without one (the chunks the target asks for move the others within it), the tight
    request's TPOT aside."""
    target_ms = 250.0
    held, _ = serve(target_dir, draft_dir, "slo")
    # without a target their first tokens come ~113, 172, 256 and 349 ms after arrival: 250 ms binds the last two
    timed, steps = serve(target_dir, draft_dir, "slo", ttft_ms=target_ms)
    assert [r.output_ids for r in timed] == [r.output_ids for r in held]  # the same tokens
    before = [r.metrics.ttft_ms for r in held[1:]]
    after = [r.metrics.ttft_ms for r in timed[1:]]
    assert all(a is not None and b is not None for a, b in zip(after, before, strict=True))
    late = [(a, b) for a, b in zip(after, before, strict=True) if b > target_ms]
    assert len(late) >= 2  # the target binds
    assert all(a < b for a, b in late)
    assert all(a <= max(b, target_ms) + 1e-6 for a, b in zip(after, before, strict=True))
    assert max(m.prefill_tokens for m in steps if m.n_decode) > min(m.prefill_tokens for m in steps if m.n_decode)
