"""What the engine predicts an iteration costs, against the forward it then runs: a prompt chunk riding beside the
decoding requests is priced over its own keys (timing.PromptLoad), with the cells the runner counts for it."""

from __future__ import annotations

from pathlib import Path

import pytest

from adaserve.engine.cost.cost_model import CostModel
from adaserve.engine.cost.timing import OnlineCostModel, PromptLoad
from adaserve.engine.engine import StepMetrics
from adaserve.engine.model.runner import ForwardRecord
from adaserve.engine.request import Phase, Request
from adaserve.engine.speculation.sampling import SamplingParams
from tests.engine.helpers import engine

# a CPU-like model whose attention cells dominate long prompt chunks
TRUE = CostModel(alpha=1e-6, gamma=1.2e-4, delta=4e-3, beta=3e-7)


def request(i: int, prompt_len: int, max_tokens: int) -> Request:
    return Request(f"r{i}", [2 + (7 * i + j) % 90 for j in range(prompt_len)],
                   SamplingParams(max_tokens=max_tokens, ignore_eos=True))


def test_a_mixed_plain_iteration_is_priced_as_the_forward_it_runs(target_dir: Path) -> None:
    """Plain decoding beside 16-token prompt chunks: each iteration's prediction is the model's price of its own target
    forward (its context, tokens and cells as the runner reported them). Spreading the chunk's tokens over the decoding
    requests' context instead priced those iterations dearer by their 16 x the mean decoding context's cells."""
    eng = engine(target_dir, None, "incremental", budget=24, prefill_chunk=16)
    # the model held fixed: a band no forward on this machine leaves, so no correction moves it
    eng.target_time = OnlineCostModel(TRUE, frozen=True, tolerance=1e9)
    records: list[ForwardRecord] = []
    eng.target.forward_listeners.append(records.append)
    steps: list[tuple[StepMetrics, ForwardRecord]] = []
    eng.step_listeners.append(lambda m: steps.append((m, records[-1])))
    for i in range(3):
        eng.add_request(request(i, 12, 30))
    for _ in range(4):  # the first three prefill in one chunk, then decode
        eng.step()
    eng.add_request(request(3, 70, 4))  # a long prompt: five chunks beside three decoding requests
    eng.add_request(request(4, 20, 4))
    while eng.has_work:
        eng.step()
    mixed = [(m, rec) for m, rec in steps if m.n_decode and m.n_prefill]
    assert len(mixed) >= 5
    for m, rec in mixed:
        assert m.predicted_iter_s == pytest.approx(TRUE.predict(rec.n_context, rec.n_new, rec.n_cells), rel=1e-9)
    # the chunks read their own keys: the forward's cells are well under the decoding context spread over them
    m, rec = mixed[-1]
    spread = (rec.n_context - m.n_prefill) * rec.n_new / m.n_decode
    assert rec.n_cells < spread


def test_the_slo_rules_chunk_is_the_one_the_iteration_cuts(target_dir: Path) -> None:
    """``Engine._prompt_load(p)``, what the SLO prefill rule prices a chunk of p tokens with, is the load of the chunks
    ``_prefill_segments`` cuts with p tokens: the prompts in order, each from where its KV ends, the last cut."""
    eng = engine(target_dir, None, "incremental", budget=24, prefill_chunk=16)
    eng.add_request(request(0, 10, 8))
    eng.step()
    eng.add_request(request(1, 40, 4))
    eng.add_request(request(2, 9, 4))
    eng.step()  # r1's first 16 prompt tokens are in its KV: the next chunk starts there
    assert [r.phase for r in eng.running] == [Phase.DECODE, Phase.PREFILL, Phase.PREFILL]
    segments = eng._prefill_segments(StepMetrics())
    assert [(s.tree.size, s.prefix_len) for _, s in segments] == [(16, 16)]
    assert eng._prompt_load(16) == PromptLoad.of([(16, 16)])
    assert eng._prompt_load(30) == PromptLoad.of([(24, 16), (6, 0)])
    assert eng._prompt_load(0) == PromptLoad()
