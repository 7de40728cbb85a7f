"""prefill_mode "separate" (vLLM v0 without chunked prefill): an iteration with prompts to prefill runs them
whole and decodes nothing; the tokens are those of "mixed" (chunked prefill beside decodes)."""

from __future__ import annotations

from pathlib import Path

import pytest

from adaserve.engine.config import EngineConfig
from adaserve.engine.engine import StepMetrics
from tests.engine.helpers import engine
from tests.engine.test_greedy_generation import run_staggered, workload


@pytest.mark.parametrize("policy", ["incremental", "chain:4"])
def test_separate_prefill_keeps_greedy_output(target_dir: Path, draft_dir: Path, policy: str) -> None:
    outputs = {}
    for mode in ("mixed", "separate"):
        eng = engine(target_dir, draft_dir, policy, budget=24, prefill_chunk=16, prefill_mode=mode)
        steps: list[StepMetrics] = []
        eng.step_listeners.append(steps.append)
        reqs = workload(10)
        run_staggered(eng, reqs)
        outputs[mode] = {r.request_id: r.output_ids for r in reqs}
        assert all(r.finish_reason == "length" for r in reqs)
        if mode == "separate":
            assert all(m.n_decode == 0 for m in steps if m.n_prefill)  # a prefill iteration decodes nothing
            assert sum(m.n_prefill for m in steps) == len(reqs)  # every prompt in one piece
            # whole prompts, up to 16 tokens together, or one longer prompt alone
            assert all(m.prefill_tokens <= 16 or m.n_prefill == 1 for m in steps)
            assert any(m.prefill_tokens > 16 for m in steps)  # the workload has prompts past the limit
        else:
            assert any(m.n_decode and m.n_prefill for m in steps)  # mixed: chunks ride with decodes
    assert outputs["separate"] == outputs["mixed"]


def test_prefill_mode_is_checked() -> None:
    with pytest.raises(ValueError, match="prefill_mode must be one of"):
        EngineConfig(prefill_mode="whole")
    with pytest.raises(ValueError, match="prefill_rule must be 'fixed'"):
        EngineConfig(prefill_mode="separate", prefill_rule="slo")
    assert EngineConfig().prefill_mode == "mixed"
