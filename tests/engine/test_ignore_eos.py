"""``ignore_eos`` (the bench's fixed output lengths, docs/benchmarks.md "--trace-json") only removes a stop:
the tokens before end-of-sequence are the ones a stopping request emits, for plain and speculative decoding."""

from __future__ import annotations

from pathlib import Path

import pytest

from adaserve.engine.request import Request
from adaserve.engine.speculation.sampling import SamplingParams
from tests.engine.helpers import engine

PROMPT = [5, 17, 42, 8, 23, 61, 3]
LENGTH = 24


def run(target: Path, draft: Path, policy: str, *, eos: int | None, ignore_eos: bool) -> Request:
    eng = engine(target, draft, policy, budget=24, prefill_chunk=16)
    if eos is not None:
        eng.stop_ids = frozenset({eos})  # an end-of-sequence token the model emits mid-output
    req = Request("r", PROMPT, SamplingParams(max_tokens=LENGTH, ignore_eos=ignore_eos))
    eng.add_request(req)
    while eng.has_work:
        eng.step()
    return req


@pytest.mark.parametrize("policy", ["incremental", "beam:3,2", "chain:4"])
def test_ignoring_eos_keeps_the_tokens_before_it(target_dir: Path, draft_dir: Path, policy: str) -> None:
    full = run(target_dir, target_dir, "incremental", eos=None, ignore_eos=True).output_ids
    assert len(full) == LENGTH
    cut = LENGTH // 2
    eos = full[cut]
    first = full.index(eos)  # the model's first emission of that token ends a stopping request
    stopped = run(target_dir, draft_dir, policy, eos=eos, ignore_eos=False)
    assert stopped.output_ids == full[:first + 1] and stopped.finish_reason == "stop"
    ignored = run(target_dir, draft_dir, policy, eos=eos, ignore_eos=True)
    assert ignored.output_ids == full and ignored.finish_reason == "length"
